"""Export benchmark: ONNX Runtime FP32 vs dynamic INT8 vs Q/DQ INT8, with PyTorch eager for reference.

Builds a random-initialized model of a preset's shape (default ``gpt2-124m``: 12 layers, 768 wide, 50257
vocabulary; big enough that INT8 GEMMs, not graph overhead, decide latency and size), a BPE tokenizer and
token shards from the packaged demo text, then runs the real stages (``export_onnx`` with the KV-cache
graph, ``quantize_int8`` with its accuracy gate) and measures per model:

* forward latency of ``decoder_model.onnx`` at batch 1 and batch 8, sequence 256 (median of ``--runs``);
* per-token decode latency with the KV cache (``model.onnx``, batch 1, after a 256-token
  prefill, median over ``--decode-tokens`` steps);
* size on disk of ``decoder_model.onnx`` (plus external data);
* held-out perplexity (from the quantize stage's gate; random weights give ~vocabulary-size perplexity,
  so only the INT8-vs-FP32 delta is meaningful).

PyTorch eager fp32 / bf16 on the same weights give the reference rows. Prints a table and writes JSON.

    python -m bench.export_bench          # writes bench/results/export_bench.json (--out elsewhere)
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import machine_facts, text_table, write_results
from lmforge.config import ExportConfig, ModelConfig, QuantizeConfig, load_preset
from lmforge.data.demo import shakespeare_documents
from lmforge.export import export_onnx, quantize_int8
from lmforge.onnx_runtime import OrtCausalLM, OrtDecoderWithPast
from tests.support.demo_artifacts import write_random_model, write_shards, write_tokenizer

log = logging.getLogger("bench.export")


def median_ms(fn: Callable[[], Any], runs: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def build_inputs(root: Path, model_cfg: ModelConfig, vocab: int, docs: int) -> tuple[Path, Path]:
    """A random-init model of ``model_cfg`` with a demo-text tokenizer, and token shards of that text."""
    texts = [d["text"] for d in itertools.islice(shakespeare_documents(), docs)]
    tokenizer = write_tokenizer(texts, root / "tokenizer", vocab_size=4096)
    write_shards(texts, tokenizer, root / "shards", shard_tokens=10_000_000)
    return write_random_model(model_cfg, tokenizer, root / "model", vocab_size=vocab), root / "shards"


def ort_rows(dirs: dict[str, Path], seq: int, runs: int, decode_tokens: int, threads: int) -> dict[str, dict]:
    """Latency and size of each ONNX model directory."""
    rng = np.random.default_rng(0)
    rows = {}
    for name, model_dir in dirs.items():
        model = OrtCausalLM(model_dir, threads=threads)
        row: dict[str, Any] = {"size_mb": model.size_bytes / 1e6}
        for batch in (1, 8):
            ids = rng.integers(0, 4096, size=(batch, seq), dtype=np.int64)
            row[f"b{batch}_ms"] = median_ms(lambda ids=ids, model=model: model.logits(ids), runs)
        del model
        decoder = OrtDecoderWithPast(model_dir, threads=threads)
        prompt = rng.integers(0, 4096, size=(1, seq), dtype=np.int64)
        mask = np.ones((1, seq), dtype=np.int64)
        _, past = decoder.step(prompt, mask, decoder.empty_past(1))
        times = []
        token = prompt[:, -1:]
        for _ in range(decode_tokens):
            mask = np.concatenate([mask, np.ones((1, 1), dtype=np.int64)], axis=1)
            start = time.perf_counter()
            logits, past = decoder.step(token, mask, past)
            times.append((time.perf_counter() - start) * 1e3)
            token = logits[:, -1].argmax(-1)[:, None]
        row["decode_ms_per_token"] = statistics.median(times[2:])
        rows[name] = row
        log.info("%s: %s", name, row)
    return rows


def torch_rows(model_dir: Path, seq: int, runs: int, decode_tokens: int) -> dict[str, dict]:
    """PyTorch eager latency in fp32 and bf16 (reference rows)."""
    from lmforge.model.build import load_causal_lm

    rng = np.random.default_rng(0)
    rows = {}
    for name, dtype in (("pytorch_fp32", torch.float32), ("pytorch_bf16", torch.bfloat16)):
        model = load_causal_lm(model_dir, dtype=dtype)
        row: dict[str, Any] = {"size_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6}
        with torch.inference_mode():
            for batch in (1, 8):
                ids = torch.from_numpy(rng.integers(0, 4096, size=(batch, seq), dtype=np.int64))
                row[f"b{batch}_ms"] = median_ms(
                    lambda ids=ids, model=model: model(input_ids=ids, use_cache=False), runs
                )
            prompt = torch.from_numpy(rng.integers(0, 4096, size=(1, seq), dtype=np.int64))
            out = model(input_ids=prompt, use_cache=True)
            cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
            token = prompt[:, -1:]
            times = []
            for _ in range(decode_tokens):
                start = time.perf_counter()
                out = model(input_ids=token, cache=cache, use_cache=True)
                times.append((time.perf_counter() - start) * 1e3)
                cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
                token = out.logits[:, -1].argmax(-1)[:, None]
        row["decode_ms_per_token"] = statistics.median(times[2:])
        rows[name] = row
        log.info("%s: %s", name, row)
        del model
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-124m", help="preset whose pretrain.model shape is benchmarked")
    parser.add_argument("--vocab", type=int, default=50257, help="model vocabulary size (GPT-2: 50257)")
    parser.add_argument("--seq", type=int, default=256, help="sequence length of the forward and the prefill")
    parser.add_argument("--runs", type=int, default=10, help="timed forward passes per point (median)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="timed decode steps (median)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="ONNX Runtime intra-op threads")
    parser.add_argument("--calibration", type=int, default=32, help="calibration sequences for Q/DQ")
    parser.add_argument("--docs", type=int, default=400, help="demo documents for tokenizer, calibration, held-out")
    parser.add_argument("--workdir", type=Path, default=None, help="keep artifacts here (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="JSON output (default: bench/results/export_bench.json)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)

    model_cfg = ModelConfig(**load_preset(args.preset)["pretrain"]["model"])
    machine = machine_facts()  # before the runs: the load they ran under
    with tempfile.TemporaryDirectory(prefix="export-bench-") as tmp:
        root = args.workdir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        model_dir, shards = build_inputs(root, model_cfg, args.vocab, args.docs)
        start = time.perf_counter()
        exported = export_onnx.run(ExportConfig(), model=model_dir, onnx_model=root / "onnx")
        export_s = time.perf_counter() - start
        qcfg = QuantizeConfig(
            calibration_sequences=args.calibration, calibration_seq_len=args.seq, gate_context=args.seq
        )
        start = time.perf_counter()
        quantized = quantize_int8.run(
            qcfg, onnx_model=root / "onnx", shards=shards, int8_dynamic=root / "dynamic", int8_qdq=root / "qdq"
        )
        quantize_s = time.perf_counter() - start
        dirs = {"ort_fp32": root / "onnx", "ort_dynamic_int8": root / "dynamic", "ort_qdq_int8": root / "qdq"}
        rows = ort_rows(dirs, args.seq, args.runs, args.decode_tokens, args.threads)
        rows.update(torch_rows(model_dir, args.seq, args.runs, args.decode_tokens))

    q = quantized.metrics
    rows["ort_fp32"]["perplexity"] = q["fp32_perplexity"]
    for name, key in (("ort_dynamic_int8", "dynamic"), ("ort_qdq_int8", "qdq")):
        rows[name]["perplexity"] = q[f"{key}_perplexity"]
        rows[name]["perplexity_delta"] = q[f"{key}_perplexity_delta"]
        rows[name]["accepted"] = bool(q[f"{key}_accepted"])
    fp32 = rows["ort_fp32"]
    ratios = {
        "dynamic_b8_latency_vs_fp32": rows["ort_dynamic_int8"]["b8_ms"] / fp32["b8_ms"],
        "dynamic_size_vs_fp32": rows["ort_dynamic_int8"]["size_mb"] / fp32["size_mb"],
        "qdq_b8_latency_vs_fp32": rows["ort_qdq_int8"]["b8_ms"] / fp32["b8_ms"],
        "qdq_size_vs_fp32": rows["ort_qdq_int8"]["size_mb"] / fp32["size_mb"],
    }
    result = {
        "model": {"preset": args.preset, **model_cfg.model_dump(), "vocab": args.vocab, "init": "random"},
        "seq": args.seq,
        "threads": args.threads,
        "export_seconds": export_s,
        "quantize_seconds": quantize_s,
        "parity_max_abs_diff": exported.metrics["parity_max_abs_diff"],
        "with_past_parity_max_abs_diff": exported.metrics["with_past_parity_max_abs_diff"],
        "rows": rows,
        "ratios": ratios,
    }
    cells = [
        [
            name,
            f"{row['size_mb']:.1f}",
            f"{row['b1_ms']:.1f}",
            f"{row['b8_ms']:.1f}",
            f"{row['decode_ms_per_token']:.2f}",
            f"{row['perplexity']:.1f}" if "perplexity" in row else "-",
            f"{row['perplexity_delta']:+.2%}" if "perplexity_delta" in row else "-",
        ]
        for name, row in rows.items()
    ]
    header = ["model", "size MB", "b1 ms", "b8 ms", "decode ms/tok", "perplexity", "delta"]
    print(text_table(header, cells, widths=[18, 9, 9, 9, 15, 12, 8], sep=""))
    print(json.dumps(ratios, indent=2))
    write_results("export_bench", result, path=args.out, machine=machine)


if __name__ == "__main__":
    main()
