"""lmforge's decode loop against CTranslate2 on the same weights: greedy tokens/s, one thread each, same run.

Two shapes with random weights and the demo tokenizer, built as ``serve_bench`` builds its model: the ``tiny-cpu``
student (2 layers, 128 wide) and ``gpt2-124m`` (12 layers, 768 wide, 50257-row embedding). lmforge runs the dynamic
INT8 ONNX model a CPU release serves (``generate_batch``, the loop the predictor batches) and, on the 124m shape, the
FP32 one too; CTranslate2 runs the Hugging Face model converted to its ``int8`` format on CPU
(``Generator.generate_batch``, greedy). Each engine decodes the same prompts in batches of 1, 8 (and whatever
``--peer-batches`` names), ``--max-tokens`` new tokens; the engines take turns for ``--rounds`` rounds and each
figure is the median round. CTranslate2 is a benchmark peer only, never a dependency of lmforge.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lmforge.config import ModelConfig
from lmforge.model.build import load_tokenizer
from lmforge.onnx_runtime import OrtDecoderWithPast
from lmforge.serve.generate import GenerationRequest, generate_batch

log = logging.getLogger("bench.decode_peers")

GPT2_124M = ModelConfig(arch="gpt2", n_layer=12, n_head=12, n_embd=768, block_size=1024)
GPT2_VOCAB = 50257
THREADS = 1

Decode = Callable[[Sequence[Sequence[int]]], int]
"""Greedily continues a batch of prompts (token ids) by ``max_tokens``; returns how many tokens it generated."""


def _pad_vocabulary(loader: Any) -> None:
    """Make CTranslate2's ``loader`` name every embedding row: the gpt2-124m shape has 50257 rows, the demo
    tokenizer 2048 tokens (the converter refuses a vocabulary shorter than the embedding)."""
    tokens_of = type(loader).get_vocabulary

    def get_vocabulary(model: Any, tokenizer: Any) -> list[str]:
        tokens = tokens_of(loader, model, tokenizer)
        return tokens + [f"<unused_{i}>" for i in range(len(tokens), model.config.vocab_size)]

    loader.get_vocabulary = get_vocabulary


def ct2_decoder(hf_model: Path, out: Path, max_tokens: int) -> Decode:
    """CTranslate2's greedy ``generate_batch`` on ``hf_model`` converted to int8 (converted once into ``out``)."""
    import ctranslate2  # a benchmark peer, not a dependency: imported only when asked for

    if not (out / "model.bin").is_file():
        _pad_vocabulary(ctranslate2.converters.transformers._MODEL_LOADERS["GPT2Config"])
        ctranslate2.converters.TransformersConverter(str(hf_model)).convert(str(out), quantization="int8", force=True)
    generator = ctranslate2.Generator(
        str(out), device="cpu", compute_type="int8", intra_threads=THREADS, inter_threads=1
    )
    tok = load_tokenizer(hf_model)

    def decode(prompts: Sequence[Sequence[int]]) -> int:
        tokens = [tok.convert_ids_to_tokens(list(p)) for p in prompts]
        results = generator.generate_batch(
            tokens, max_length=max_tokens, sampling_topk=1, include_prompt_in_result=False
        )
        return sum(len(r.sequences_ids[0]) for r in results)

    return decode


def lmforge_decoder(onnx_dir: Path, max_tokens: int) -> Decode:
    """lmforge's ``generate_batch`` on the KV-cache graph of ``onnx_dir``, greedy."""
    decoder = OrtDecoderWithPast(onnx_dir, threads=THREADS, spinning=False)
    tok = load_tokenizer(onnx_dir)

    def decode(prompts: Sequence[Sequence[int]]) -> int:
        requests = [GenerationRequest(tuple(p), max_tokens) for p in prompts]
        results = generate_batch(decoder, requests, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        return sum(len(r.token_ids) for r in results)

    return decode


def tokens_per_s(decode: Decode, prompts: Sequence[Sequence[int]], batch: int) -> float:
    """Generated tokens/s decoding ``prompts`` in batches of ``batch`` (at least two batches, 8 prompts)."""
    count = max(2 * batch, 8)
    chosen = [prompts[i % len(prompts)] for i in range(count - count % batch)]
    start = time.perf_counter()
    tokens = sum(decode(chosen[i : i + batch]) for i in range(0, len(chosen), batch))
    return tokens / (time.perf_counter() - start)


def engine_rows(
    shape: str, engines: dict[str, Decode], prompts: Sequence[Sequence[int]], batches: Sequence[int], rounds: int
) -> list[dict[str, Any]]:
    """Per engine and batch size, the median tokens/s over ``rounds`` (the engines taking turns each round)."""
    for decode in engines.values():  # warm up
        decode(prompts[:2])
    runs: dict[tuple[str, int], list[float]] = {}
    loads: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for batch in batches:
            for name, decode in engines.items():
                runs.setdefault((name, batch), []).append(tokens_per_s(decode, prompts, batch))
                loads.setdefault((name, batch), []).append(os.getloadavg()[0])
    rows = []
    for (name, batch), values in runs.items():
        row = {
            "shape": shape,
            "engine": name,
            "batch": batch,
            "threads": THREADS,
            "tokens_per_s": statistics.median(values),
            "tokens_per_s_each_round": values,
            "load_1m": loads[(name, batch)],
        }
        log.info("%s", row)
        rows.append(row)
    return rows


def ratios(rows: Sequence[dict[str, Any]], peer: str = "ct2_int8") -> dict[str, float]:
    """``<shape>/<engine>/batch<b>``: that lmforge engine's median tokens/s over the peer's, same shape and batch."""
    by = {(r["shape"], r["engine"], r["batch"]): r["tokens_per_s"] for r in rows}
    return {
        f"{shape}/{engine}/batch{batch}": value / by[(shape, peer, batch)]
        for (shape, engine, batch), value in by.items()
        if engine != peer and (shape, peer, batch) in by
    }
