"""Speed table of the demo student across runtimes: PyTorch, ONNX Runtime FP32 and INT8 (dynamic).

    python -m bench.eval_bench                       # a random student of the tiny-cpu shape
    python -m bench.eval_bench --student DIR --onnx DIR [--int8 DIR]   # real artifacts of a run

Every runtime is measured in its own subprocess (so its peak RSS is its own) with the harness the
``evaluate`` stage uses (:mod:`lmforge.metrics.latency`): full forward passes of ``--context`` tokens
(= prefill) at batch 1 and 8, and KV-cache generation (prefill of ``--prompt`` tokens, then
``--new-tokens`` decode steps) at batch 1 and 8 where the runtime has a cache (an ONNX directory needs
``model.onnx``, the cache graph). Warm-up runs come first. Prints a Markdown table; ``--json PATH`` also writes
the figures there with the machine facts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.common import machine_facts, markdown_table, peak_rss_mb, write_results

BATCHES = (1, 8)


def _measure(kind: str, path: str, args: argparse.Namespace) -> dict:
    import torch

    from lmforge.metrics.latency import (
        OrtDecodeRuntime,
        TorchDecodeRuntime,
        latency_profile,
        measure_decode,
    )
    from lmforge.metrics.perplexity import onnx_logits_fn, torch_logits_fn

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 2000, size=8 * args.context, dtype=np.int64)
    runtime = None
    if kind == "pytorch":
        from lmforge.model.build import load_causal_lm

        model = load_causal_lm(path)
        logits_fn, runtime = torch_logits_fn(model), TorchDecodeRuntime(model)
    else:
        from lmforge.onnx_runtime import WITH_PAST_FILE, OrtCausalLM, OrtDecoderWithPast

        logits_fn = onnx_logits_fn(OrtCausalLM(path, threads=args.threads))
        if Path(path, WITH_PAST_FILE).is_file():
            runtime = OrtDecodeRuntime(OrtDecoderWithPast(Path(path, WITH_PAST_FILE), threads=args.threads))
    out: dict = {"forward": {}, "decode": {}}
    profile = latency_profile(logits_fn, tokens, context=args.context, runs=args.runs, batch_sizes=BATCHES)
    out["forward"] = {b: r.to_dict() for b, r in profile.items()}
    if runtime is not None:
        for b in BATCHES:
            ids = tokens[: b * args.prompt].reshape(b, args.prompt)
            speed = measure_decode(runtime, ids, new_tokens=args.new_tokens, runs=max(2, args.runs // 4))
            out["decode"][b] = speed.to_dict()
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def build_random_student(root: Path) -> dict[str, str]:
    """A random student of the tiny-cpu distilled shape (2 layers, 4 heads, 128 wide, vocab 2048, 128 positions)."""
    import shutil

    from onnxruntime.quantization import QuantType, quantize_dynamic
    from transformers import PreTrainedTokenizerFast

    from lmforge.artifacts import write_manifest
    from lmforge.config import ExportConfig, ModelConfig
    from lmforge.export import export_onnx
    from lmforge.model.build import build_model, save_model_dir

    shape = ModelConfig(arch="gpt2", n_layer=2, n_head=4, n_embd=128, block_size=128)
    from tokenizers import Tokenizer, models

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(2048)}, unk_token="t0")),
        eos_token="t1",
        pad_token="t2",
    )
    model = build_model(shape, 2048, eos_id=1, pad_id=2, seed=0)
    student = save_model_dir(model, tok, root / "student")
    write_manifest(student, "model")
    export_onnx.run(ExportConfig(), model=student, onnx_model=root / "onnx_fp32")
    int8 = root / "int8_dynamic"
    int8.mkdir()
    for file in sorted((root / "onnx_fp32").glob("*.onnx")):
        quantize_dynamic(file, int8 / file.name, weight_type=QuantType.QInt8)
    shutil.copy(root / "onnx_fp32" / "config.json", int8 / "config.json")
    return {"pytorch": str(student), "onnx_fp32": str(root / "onnx_fp32"), "int8_dynamic": str(int8)}


def _fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


HEADER = (
    "runtime",
    "fwd p50 / p90 / p99 ms (b1)",
    "fwd p99 ms (b8)",
    "fwd tokens/s (b1 / b8)",
    "prefill p99 ms (b1)",
    "decode p50 / p90 / p99 ms/token (b1)",
    "decode p99 ms (b8)",
    "decode tokens/s (b1 / b8)",
    "peak RSS MB",
)


def table(results: dict[str, dict]) -> str:
    """The Markdown speed table."""
    rows = []
    for name, r in results.items():
        f1, f8 = r["forward"]["1"], r["forward"]["8"]
        d1, d8 = r["decode"].get("1"), r["decode"].get("8")
        rows.append(
            [
                name,
                f"{_fmt(f1['p50_ms'])} / {_fmt(f1['p90_ms'])} / {_fmt(f1['p99_ms'])}",
                _fmt(f8["p99_ms"]),
                f"{f1['tokens_per_s']:.0f} / {f8['tokens_per_s']:.0f}",
                _fmt(d1 and d1["prefill_p99_ms"]),
                f"{_fmt(d1 and d1['decode_p50_ms'])} / {_fmt(d1 and d1['decode_p90_ms'])} / "
                f"{_fmt(d1 and d1['decode_p99_ms'])}",
                _fmt(d8 and d8["decode_p99_ms"]),
                f"{_fmt(d1 and d1['decode_tokens_per_s'], 0)} / {_fmt(d8 and d8['decode_tokens_per_s'], 0)}",
                f"{r['peak_rss_mb']:.0f}",
            ]
        )
    return markdown_table(HEADER, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student", help="HF student model directory (default: a random tiny-cpu student)")
    parser.add_argument("--onnx", help="ONNX FP32 directory of the student")
    parser.add_argument("--int8", help="ONNX INT8 directory of the student")
    parser.add_argument("--context", type=int, default=128, help="forward-pass length (tokens)")
    parser.add_argument("--prompt", type=int, default=32, help="prompt length for generation")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per timed generation")
    parser.add_argument("--runs", type=int, default=20, help="timed forward passes per shape")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads for every runtime (same for all)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here (JSON)")
    parser.add_argument("--one", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.one:  # child process: measure one runtime, print JSON
        print(json.dumps(_measure(args.one[0], args.one[1], args)))
        return

    machine = machine_facts()  # before the runs: the load they ran under
    with tempfile.TemporaryDirectory(prefix="eval-bench-") as tmp:
        if args.student:
            runtimes = {"pytorch": args.student}
            runtimes.update({k: v for k, v in (("onnx_fp32", args.onnx), ("int8_dynamic", args.int8)) if v})
        else:
            runtimes = build_random_student(Path(tmp))
        results = {}
        for name, path in runtimes.items():
            kind = "pytorch" if name == "pytorch" else "onnx"
            passthrough = ["--context", str(args.context), "--prompt", str(args.prompt)]
            passthrough += [
                "--new-tokens",
                str(args.new_tokens),
                "--runs",
                str(args.runs),
                "--threads",
                str(args.threads),
            ]
            child = subprocess.run(
                [sys.executable, "-m", __spec__.name, "--one", kind, path, *passthrough],
                capture_output=True,
                text=True,
                check=True,
            )
            results[name] = json.loads(child.stdout.strip().splitlines()[-1])
    print(
        f"Python {machine['python']}, {machine['machine']}, context {args.context}, prompt {args.prompt}, "
        f"{args.new_tokens} new tokens, {args.runs} runs"
    )
    print(table(results))
    if args.json:
        setup = {k: getattr(args, k) for k in ("context", "prompt", "new_tokens", "runs", "threads")}
        record = {"setup": setup, "runtimes": runtimes, "results": results}
        write_results("eval_bench", record, path=args.json, machine=machine)


if __name__ == "__main__":
    main()
