"""Serving benchmark: the lmforge predictor under load on loopback, with and without batching, and
``transformers`` ``generate`` in a loop at the same concurrency.

Model: ``--model`` (a release ``models/<name>/<version>/``, whose ``student`` is the PyTorch peer, or an ONNX model
directory with ``--hf-model`` for the peer), else one of the demo's served shape is built: the ``tiny-cpu`` student
(GPT-2, 2 layers, 4 heads, 128 wide, 128 context, 2048-token BPE trained on the demo text), random weights, exported
by the real ``export_onnx`` stage and quantized by ``quantize_int8`` (the dynamic INT8 model is what a CPU release
serves).
Random weights rarely emit EOS, so nearly every request generates ``--max-tokens`` tokens: the worst case.

For each round, mode and concurrency (1, 8, 32 by default) a closed loop of ``concurrency`` clients sends
prompts from the demo text to ``/openai/v1/completions`` (greedy, ``max_tokens``) until ``--requests`` requests
are answered or ``--duration-s`` has passed, whichever is first. Modes:

* ``batched`` — the predictor with continuous batching (``--max-batch-size``, ``--max-wait-ms``); its ``mean_batch``
  is the mean size of the groups that joined the running batch;
* ``unbatched`` — the same predictor with ``max_batch_size`` 1 (one request at a time, in arrival order);
* ``transformers`` — the HF model (FP32 PyTorch) in this process, ``concurrency`` threads each calling
  ``generate(do_sample=False)`` for one prompt at a time (no server, no HTTP);
* ``decode`` — the predictor's batched decoding alone (``generate_batch`` on the served ONNX model in this
  process, batch = concurrency, no HTTP, no queue): what batching buys where HTTP and tokenizing cost nothing.
* ``scheduler`` — the predictor's schedulers alone (this process, no HTTP, no tokenizing), taking turns: the
  continuous batcher the predictor runs and the batch-at-a-time one (``DynamicBatcher`` over ``generate_batch``),
  a closed loop of ``concurrency`` clients each;
* ``hostile`` — the batched predictor under ``--requests`` requests at each concurrency, once with well-formed
  requests only and once with ``--hostile-share`` of them hostile (bad sampling values, 10k-prompt bodies,
  malformed and 100k-deep JSON: ``tests/support/serve_helpers.py``), the two loads taking turns on one server:
  the well-formed requests' latency with and without the hostile ones, every status, and the server's log lines
  per request.

Client and server share the machine's cores: on 2 cores the load generator's own work is in the figures. The
modes take turns for ``--rounds`` rounds (a fresh server each time), so a change in the machine's other load
falls on all of them; the table shows, per mode and concurrency, the round with the median tokens/s, and the JSON
keeps every round. Reports p50/p90/p99 request latency, generated tokens/s and requests/s.

    python -m bench.serve_bench                                          # the built model
    python -m bench.serve_bench --model lmforge-out/registry/models/lmforge-demo/<version>   # the demo's release

``--peer ct2`` adds, after the modes, lmforge's decode loop against CTranslate2 on the student and the ``gpt2-124m``
shapes (:mod:`bench.decode_peers`; ``pip install ctranslate2``: a benchmark peer, not an lmforge dependency).

The record (``bench/results/serve_bench.json`` unless ``--out``) carries the machine's facts (``bench.common``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from bench import decode_peers
from bench.common import load_average, machine_facts, result_path, text_table, write_results
from lmforge.config import ExportConfig, ModelConfig, QuantizeConfig, load_preset
from lmforge.data.demo import shakespeare_documents
from lmforge.export import export_onnx, quantize_int8
from lmforge.model.build import load_causal_lm, load_tokenizer
from lmforge.onnx_runtime import OrtDecoderWithPast
from lmforge.serve.batcher import Batcher, ContinuousBatcher, DoneEvent, DynamicBatcher
from lmforge.serve.generate import GenerationRequest, RunningBatch, generate_batch
from lmforge.serve.model_dir import is_release, resolve_served_model
from tests.support.demo_artifacts import write_random_model, write_shards, write_tokenizer
from tests.support.serve_helpers import mixed_load, serving

log = logging.getLogger("bench.serve")
STUDENT = ModelConfig(arch="gpt2", n_layer=2, n_head=4, n_embd=128, block_size=128)
MODEL_NAME = "bench"


def build_demo_model(
    root: Path, docs: int = 200, *, shape: ModelConfig = STUDENT, vocab_size: int | None = None
) -> tuple[Path, Path]:
    """A model of ``shape`` (default: the tiny-cpu student) with random weights and the demo tokenizer, its
    embedding ``vocab_size`` rows (default: the tokenizer's): (HF model dir, dynamic INT8 ONNX dir)."""
    texts = [d["text"] for d in itertools.islice(shakespeare_documents(), docs)]
    tokenizer = write_tokenizer(texts, root / "tokenizer", vocab_size=2048)
    write_shards(texts, tokenizer, root / "shards", shard_tokens=10_000_000)
    write_random_model(shape, tokenizer, root / "model", vocab_size)
    export_onnx.run(ExportConfig(), model=root / "model", onnx_model=root / "onnx")
    qcfg = QuantizeConfig.model_validate(load_preset("tiny-cpu")["quantize_int8"])
    quantize_int8.run(
        qcfg, onnx_model=root / "onnx", shards=root / "shards", int8_dynamic=root / "int8", int8_qdq=root / "qdq"
    )
    return root / "model", root / "int8"


def prompts(tokenizer: Any, count: int = 64, max_tokens: int = 32, context: int = 128) -> list[str]:
    """Lines of the demo text, 8 to 48 tokens long, that leave room for ``max_tokens``."""
    out = []
    for doc in shakespeare_documents():
        for line in doc["text"].splitlines():
            n = len(tokenizer(line)["input_ids"])
            if 8 <= n <= min(48, context - max_tokens):
                out.append(line)
                if len(out) == count:
                    return out
    return out


def percentiles(latencies_s: list[float]) -> dict[str, float]:
    """p50/p90/p99 in milliseconds."""
    values = np.array(latencies_s) * 1e3
    return {f"p{q}_ms": float(np.percentile(values, q)) for q in (50, 90, 99)}


def summarize(latencies: list[float], tokens: int, wall: float) -> dict[str, Any]:
    """Latency percentiles, generated tokens/s and requests/s of one run."""
    return {
        "requests": len(latencies),
        **percentiles(latencies),
        "tokens_per_s": tokens / wall,
        "requests_per_s": len(latencies) / wall,
        "wall_s": wall,
        "generated_tokens": tokens,
    }


async def _load(url: str, texts: list[str], concurrency: int, requests: int, duration_s: float, max_tokens: int):
    latencies: list[float] = []
    tokens = 0
    sent = itertools.count()
    deadline = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:

        async def worker() -> None:
            nonlocal tokens
            while time.monotonic() < deadline and (i := next(sent)) < requests:
                body = {"model": MODEL_NAME, "prompt": texts[i % len(texts)], "max_tokens": max_tokens}
                start = time.perf_counter()
                resp = await client.post(f"{url}/openai/v1/completions", json={**body, "temperature": 0})
                latencies.append(time.perf_counter() - start)
                resp.raise_for_status()
                tokens += resp.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, tokens, time.perf_counter() - start


def server_rows(
    model: Path, mode: str, overrides: dict[str, Any], levels: list[int], texts: list[str], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Run every concurrency level against one predictor process."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp, serving(model, Path(tmp) / "serve.log", overrides) as server:
        stats_url = f"{server.url}/lmforge/v1/models/{MODEL_NAME}/stats"
        asyncio.run(_load(server.url, texts, 4, 16, args.duration_s, args.max_tokens))  # warm up
        for concurrency in levels:
            before = httpx.get(stats_url).json()
            lat, tokens, wall = asyncio.run(
                _load(server.url, texts, concurrency, args.requests, args.duration_s, args.max_tokens)
            )
            after = httpx.get(stats_url).json()
            batches = after["batches"] - before["batches"]
            row = {"mode": mode, "concurrency": concurrency, **summarize(lat, tokens, wall)}
            row["mean_batch"] = (after["requests"] - before["requests"]) / batches if batches else 0.0
            row["load_1m_after"] = os.getloadavg()[0]
            log.info("%s", row)
            rows.append(row)
    return rows


def hostile_rows(
    model: Path, overrides: dict[str, Any], levels: list[int], texts: list[str], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Clean and hostile loads taking turns on one batched predictor, per concurrency level."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp, serving(model, Path(tmp) / "serve.log", overrides) as server:
        asyncio.run(_load(server.url, texts, 4, 16, args.duration_s, args.max_tokens))  # warm up
        for concurrency in levels:
            for share in (0.0, args.hostile_share):
                lines_before = len(server.log_file.read_text(errors="replace").splitlines())
                start = time.perf_counter()
                answers = asyncio.run(
                    mixed_load(
                        server.url,
                        texts,
                        model=MODEL_NAME,
                        requests=args.requests,
                        concurrency=concurrency,
                        hostile_share=share,
                        max_tokens=args.max_tokens,
                    )
                )
                wall = time.perf_counter() - start
                lines = len(server.log_file.read_text(errors="replace").splitlines()) - lines_before
                good = [a for a in answers if not a.hostile]
                hostile = [a for a in answers if a.hostile]
                kinds = sorted({a.kind for a in hostile})
                row = {
                    "mode": "hostile" if share else "clean",
                    "concurrency": concurrency,
                    "requests": len(answers),
                    "hostile_requests": len(hostile),
                    **percentiles([a.latency_s for a in good]),
                    "requests_per_s": len(answers) / wall,
                    "wall_s": wall,
                    "good_not_200": sum(a.status != 200 for a in good),
                    "hostile_not_4xx": sum(not 400 <= a.status < 500 for a in hostile),
                    "hostile_statuses": {k: sorted({a.status for a in hostile if a.kind == k}) for k in kinds},
                    "log_lines": lines,
                    "log_lines_per_request": lines / len(answers),
                    "load_1m_after": os.getloadavg()[0],
                }
                log.info("%s", row)
                rows.append(row)
    return rows


def transformers_rows(hf_model: Path, levels: list[int], texts: list[str], args: argparse.Namespace) -> list[dict]:
    """``concurrency`` threads, each calling ``generate`` on one prompt at a time."""
    tok = load_tokenizer(hf_model)
    model = load_causal_lm(hf_model).eval()
    encoded = [torch.tensor([tok(t)["input_ids"]]) for t in texts]

    def one(i: int) -> int:
        ids = encoded[i % len(encoded)]
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.max_tokens,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        new = out[0, ids.shape[1] :].tolist()
        return new.index(tok.eos_token_id) if tok.eos_token_id in new else len(new)

    for i in range(4):  # warm up
        one(i)
    rows = []
    for concurrency in levels:
        latencies: list[float] = []
        counts: list[int] = []
        sent = itertools.count()
        lock = threading.Lock()
        deadline = time.monotonic() + args.duration_s

        def worker(sent=sent, deadline=deadline, latencies=latencies, counts=counts, lock=lock) -> None:
            while time.monotonic() < deadline:
                with lock:
                    i = next(sent)
                if i >= args.requests:
                    return
                start = time.perf_counter()
                n = one(i)
                with lock:
                    latencies.append(time.perf_counter() - start)
                    counts.append(n)

        start = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        row = {
            "mode": "transformers",
            "concurrency": concurrency,
            **summarize(latencies, sum(counts), time.perf_counter() - start),
        }
        row["mean_batch"] = 1.0
        row["load_1m_after"] = os.getloadavg()[0]
        log.info("%s", row)
        rows.append(row)
    return rows


def median_rows(every: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (mode, concurrency), the round with the median tokens/s (the lower middle one for an even count)."""
    keys = list(dict.fromkeys((r["mode"], r["concurrency"]) for r in every))
    out = []
    for key in keys:
        runs = sorted((r for r in every if (r["mode"], r["concurrency"]) == key), key=lambda r: r["tokens_per_s"])
        out.append(runs[(len(runs) - 1) // 2])
    return out


def decode_rows(served: Path, levels: list[int], texts: list[str], args: argparse.Namespace) -> list[dict]:
    """Batches of ``concurrency`` prompts through ``generate_batch``; every request's latency is its batch's."""
    model_dir = resolve_served_model(served).path
    tok = load_tokenizer(model_dir)
    decoder = OrtDecoderWithPast(model_dir, threads=args.threads, spinning=False)
    requests = [GenerationRequest(tuple(tok(t)["input_ids"]), args.max_tokens) for t in texts]
    eos, pad = tok.eos_token_id, tok.pad_token_id
    generate_batch(decoder, requests[:8], eos_token_id=eos, pad_token_id=pad)  # warm up
    rows = []
    for concurrency in levels:
        latencies: list[float] = []
        tokens = 0
        start = time.perf_counter()
        for first in range(0, args.requests, concurrency):
            batch = [requests[i % len(requests)] for i in range(first, min(first + concurrency, args.requests))]
            t = time.perf_counter()
            results = generate_batch(decoder, batch, eos_token_id=eos, pad_token_id=pad)
            latencies += [time.perf_counter() - t] * len(batch)
            tokens += sum(len(r.token_ids) for r in results)
            if time.perf_counter() - start > args.duration_s:
                break
        row = {
            "mode": "decode",
            "concurrency": concurrency,
            **summarize(latencies, tokens, time.perf_counter() - start),
        }
        row["mean_batch"] = float(concurrency)
        row["load_1m_after"] = os.getloadavg()[0]
        log.info("%s", row)
        rows.append(row)
    return rows


def built(root: Path, shape: ModelConfig = STUDENT, vocab_size: int | None = None) -> tuple[Path, Path]:
    """:func:`build_demo_model` into ``root``, unless an earlier run left it there: (HF model dir, INT8 ONNX dir)."""
    if not (root / "int8" / "model.onnx").is_file():
        root.mkdir(parents=True, exist_ok=True)
        build_demo_model(root, shape=shape, vocab_size=vocab_size)
    return root / "model", root / "int8"


def peer_rows(root: Path, texts: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """lmforge's decode loop and CTranslate2 on the student and the gpt2-124m shapes (:mod:`bench.decode_peers`)."""
    rows = []
    shapes = {"student": (STUDENT, None), "gpt2-124m": (decode_peers.GPT2_124M, decode_peers.GPT2_VOCAB)}
    for name, (shape, vocab) in shapes.items():
        hf_model, int8 = built(root / name, shape, vocab)
        tok = load_tokenizer(hf_model)
        ids = [tok(t)["input_ids"] for t in texts]
        engines = {"lmforge_int8": decode_peers.lmforge_decoder(int8, args.max_tokens)}
        if name == "gpt2-124m":
            engines["lmforge_fp32"] = decode_peers.lmforge_decoder(root / name / "onnx", args.max_tokens)
        engines["ct2_int8"] = decode_peers.ct2_decoder(hf_model, root / name / "ct2", args.max_tokens)
        rows += decode_peers.engine_rows(name, engines, ids, args.peer_batches, args.rounds)
    return rows


def scheduler_rows(served: Path, levels: list[int], texts: list[str], args: argparse.Namespace) -> list[dict]:
    """The predictor's two schedulers in this process, no HTTP: ``continuous`` (:class:`ContinuousBatcher`, what the
    predictor runs) and ``batch_at_a_time`` (:class:`DynamicBatcher` over ``generate_batch``), taking turns per
    concurrency level, ``--max-batch-size`` and ``--max-wait-ms`` each; a closed loop of ``concurrency`` clients."""
    model_dir = resolve_served_model(served).path
    tok = load_tokenizer(model_dir)
    decoder = OrtDecoderWithPast(model_dir, threads=args.threads, spinning=False)
    requests = [GenerationRequest(tuple(tok(t)["input_ids"]), args.max_tokens) for t in texts]
    eos, pad = tok.eos_token_id, tok.pad_token_id
    bounds = {"max_batch_size": args.max_batch_size, "max_wait_ms": args.max_wait_ms, "max_queue": 1024}
    schedulers = {
        "continuous": lambda: ContinuousBatcher(
            lambda cb: RunningBatch(decoder, eos_token_id=eos, pad_token_id=pad, on_token=cb), **bounds
        ),
        "batch_at_a_time": lambda: DynamicBatcher(
            lambda r, cb: generate_batch(decoder, r, eos_token_id=eos, pad_token_id=pad, on_token=cb), **bounds
        ),
    }

    async def closed_loop(batcher: Batcher, concurrency: int) -> tuple[list[float], int, float]:
        latencies: list[float] = []
        sent = iter(range(args.requests))

        async def client() -> None:
            for i in sent:
                start = time.perf_counter()
                events = batcher.submit(requests[i % len(requests)])
                while not isinstance(event := await events.get(), DoneEvent):
                    pass
                latencies.append(time.perf_counter() - start)
                counts.append(len(event.result.token_ids))

        counts: list[int] = []
        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        batcher.close()
        return latencies, sum(counts), time.perf_counter() - start

    rows = []
    for concurrency in levels:
        for name, make in schedulers.items():
            lat, tokens, wall = asyncio.run(closed_loop(make(), concurrency))
            row = {"mode": f"scheduler_{name}", "concurrency": concurrency, **summarize(lat, tokens, wall)}
            row["mean_batch"] = 0.0
            row["load_1m_after"] = os.getloadavg()[0]
            log.info("%s", row)
            rows.append(row)
    return rows


def hostile_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per concurrency: the well-formed requests' p99 under the hostile load over the clean one's (same round and
    server; each round's ratio and their median), the statuses that missed, and the log lines per request."""
    summary: dict[str, Any] = {"every_round": rows, "by_concurrency": {}}
    for concurrency in sorted({r["concurrency"] for r in rows}):
        pairs = {}
        for r in rows:
            if r["concurrency"] == concurrency:
                pairs.setdefault(r["round"], {})[r["mode"]] = r
        ratios = [p["hostile"]["p99_ms"] / p["clean"]["p99_ms"] for p in pairs.values() if len(p) == 2]
        mine = [r for r in rows if r["concurrency"] == concurrency]
        entry = {
            "p99_ratio_hostile_over_clean": float(np.median(ratios)),
            "p99_ratio_each_round": ratios,
            "clean_p99_ms_median": float(np.median([r["p99_ms"] for r in mine if r["mode"] == "clean"])),
            "hostile_p99_ms_median": float(np.median([r["p99_ms"] for r in mine if r["mode"] == "hostile"])),
            "good_not_200": sum(r["good_not_200"] for r in mine),
            "hostile_not_4xx": sum(r["hostile_not_4xx"] for r in mine),
            "log_lines_per_request_max": max(r["log_lines_per_request"] for r in mine),
        }
        summary["by_concurrency"][str(concurrency)] = entry
        print(f"hostile load at concurrency {concurrency}:", {k: v for k, v in entry.items() if "each" not in k})
    return summary


def print_table(rows: list[dict[str, Any]]) -> None:
    """One line per mode and concurrency."""
    header = ["mode", "conc", "reqs", "p50 ms", "p90 ms", "p99 ms", "tok/s", "req/s", "batch"]
    cells = [
        [
            *(r["mode"], r["concurrency"], r["requests"]),
            *(f"{r[key]:.1f}" for key in ("p50_ms", "p90_ms", "p99_ms")),
            *(f"{r['tokens_per_s']:.0f}", f"{r['requests_per_s']:.1f}", f"{r['mean_batch']:.2f}"),
        ]
        for r in rows
    ]
    print(text_table(header, cells))


def main() -> None:
    """Build or take the model, run every mode, print and write the results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="release dir or ONNX model dir to serve (default: build one)")
    parser.add_argument(
        "--hf-model", type=Path, help="HF model dir for the transformers peer (default: a release's student)"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=96, help="requests per mode and concurrency, at most")
    parser.add_argument("--duration-s", type=float, default=60.0, help="seconds per mode and concurrency, at most")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: all)")
    parser.add_argument("--modes", nargs="+", default=["batched", "unbatched", "transformers", "decode"])
    parser.add_argument("--rounds", type=int, default=3, help="times every mode runs, taking turns")
    parser.add_argument("--hostile-share", type=float, default=0.1, help="share of hostile requests (hostile mode)")
    parser.add_argument("--peer", choices=["ct2"], help="also run lmforge's decode loop against CTranslate2")
    parser.add_argument("--peer-batches", type=int, nargs="+", default=[1, 8], help="batch sizes of --peer")
    parser.add_argument("--build-dir", type=Path, help="where built models are kept between runs (default: temp)")
    parser.add_argument("--out", type=Path, default=result_path("serve_bench"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    with tempfile.TemporaryDirectory() as tmp:
        root = args.build_dir or Path(tmp)
        if args.model is None:
            hf_model, served = built(root / "student")
        else:
            release_student = args.model / "student" if is_release(args.model) else None
            hf_model, served = args.hf_model or release_student, args.model
        tok = load_tokenizer(hf_model or served)
        texts = prompts(tok, max_tokens=args.max_tokens)
        common = {"model_name": MODEL_NAME, "max_tokens_limit": max(256, args.max_tokens), "threads": args.threads}
        modes = {
            "batched": {**common, "max_batch_size": args.max_batch_size, "max_wait_ms": args.max_wait_ms},
            "unbatched": {**common, "max_batch_size": 1},
        }
        machine = machine_facts()
        every: list[dict[str, Any]] = []
        for round_ in range(1, args.rounds + 1):
            for mode in args.modes:
                if mode == "transformers":
                    if hf_model is None:
                        log.warning("no --hf-model: skipping the transformers peer")
                        continue
                    new = transformers_rows(hf_model, args.concurrency, texts, args)
                elif mode == "decode":
                    new = decode_rows(served, args.concurrency, texts, args)
                elif mode == "scheduler":
                    new = scheduler_rows(served, args.concurrency, texts, args)
                elif mode == "hostile":
                    new = hostile_rows(served, modes["batched"], args.concurrency, texts, args)
                else:
                    new = server_rows(served, mode, modes[mode], args.concurrency, texts, args)
                every += [{**row, "round": round_} for row in new]
        peer = peer_rows(root, texts, args) if args.peer else []
    hostile = [r for r in every if r["mode"] in ("clean", "hostile")]
    every = [r for r in every if r["mode"] not in ("clean", "hostile")]
    rows = median_rows(every)
    if rows:
        print_table(rows)
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    speedup = {
        str(c): by[("batched", c)]["tokens_per_s"] / by[("unbatched", c)]["tokens_per_s"]
        for c in args.concurrency
        if ("batched", c) in by and ("unbatched", c) in by
    }
    print("batching speed-up (tokens/s, batched / unbatched):", {k: round(v, 2) for k, v in speedup.items()})
    result = {
        "model": str(args.model) if args.model else f"built: tiny-cpu student shape {STUDENT.model_dump()}, INT8",
        "served": str(resolve_served_model(served).reason) if args.model else "int8_dynamic (built)",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": rows,
        "every_round": every,
        "batching_speedup_tokens_per_s": speedup,
    }
    if hostile:
        result["hostile"] = hostile_summary(hostile)
    if peer:
        result["peer"] = {"rows": peer, "ratios_over_ct2_int8": decode_peers.ratios(peer)}
        print("lmforge / ct2 tokens/s:", {k: round(v, 2) for k, v in result["peer"]["ratios_over_ct2_int8"].items()})
    machine = {**machine, "load_average_after": load_average()}  # load_average: at the start
    print(f"wrote {write_results('serve_bench', result, path=args.out, machine=machine)}")


if __name__ == "__main__":
    main()
