"""Latency of any model: forward passes (:func:`latency_profile`) and KV-cache generation (:func:`measure_decode`).

Forward passes: a fixed input of ``batch_size × context`` held-out tokens is run ``warmup`` times untimed (allocator,
thread pools, lazy initialization), then ``runs`` times timed, one full forward pass without KV cache
each. Reported: p50/p90/p99 and mean milliseconds per pass, and tokens/s = ``B·T`` / mean seconds.
Generation: a prefill of the prompt, then one decode step per new token with the cache, the same
harness for PyTorch and ONNX Runtime through :class:`DecodeRuntime`; warm-up generations run first.
Numbers from a shared CI machine are indicative only; the gate's threshold is meant for the serving
hardware.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

from lmforge.metrics.perplexity import LogitsFn

DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 8)


class _Record:
    """A dataclass of figures, written to JSON as a plain mapping."""

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping (for JSON)."""
        return asdict(self)  # type: ignore[call-overload]  # every subclass is a dataclass


@dataclass(frozen=True)
class LatencyResult(_Record):
    """Latency statistics of one input shape."""

    batch_size: int
    context: int
    runs: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    tokens_per_s: float


def input_batch(tokens: np.ndarray, *, batch_size: int, context: int) -> np.ndarray:
    """``[batch_size, context]`` int64 ids from the start of ``tokens`` (repeated if too few)."""
    flat = np.asarray(tokens[: batch_size * context]).astype(np.int64).reshape(-1)
    if flat.size == 0:
        raise ValueError("no tokens to build a latency input from")
    return np.resize(flat, (batch_size, context))


def measure_latency(
    logits_fn: LogitsFn,
    ids: np.ndarray,
    *,
    runs: int,
    warmup: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> LatencyResult:
    """Time ``runs`` forward passes of ``ids`` (``[B, T]``) after ``warmup`` untimed ones."""
    if runs < 1:
        raise ValueError(f"runs must be at least 1, got {runs}")
    for _ in range(warmup):
        logits_fn(ids)
    elapsed = np.empty(runs, dtype=np.float64)
    for i in range(runs):
        start = clock()
        logits_fn(ids)
        elapsed[i] = clock() - start
    ms = elapsed * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    mean_s = float(elapsed.mean())
    batch, context = ids.shape
    return LatencyResult(
        batch_size=int(batch),
        context=int(context),
        runs=runs,
        p50_ms=float(p50),
        p90_ms=float(p90),
        p99_ms=float(p99),
        mean_ms=mean_s * 1e3,
        tokens_per_s=batch * context / mean_s if mean_s > 0 else float("inf"),
    )


def latency_profile(
    logits_fn: LogitsFn,
    tokens: np.ndarray,
    *,
    context: int,
    runs: int,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    warmup: int = 3,
) -> dict[int, LatencyResult]:
    """:func:`measure_latency` at each batch size, inputs taken from ``tokens``."""
    return {
        b: measure_latency(logits_fn, input_batch(tokens, batch_size=b, context=context), runs=runs, warmup=warmup)
        for b in batch_sizes
    }


class DecodeRuntime(Protocol):
    """A model that generates with a KV cache: one prefill, then one step per new token."""

    def prefill(self, ids: np.ndarray) -> tuple[np.ndarray, Any]:
        """Next-token ids ``[B]`` after the prompt ``ids`` ``[B, T]``, and the cache."""
        ...

    def decode(self, token: np.ndarray, state: Any) -> tuple[np.ndarray, Any]:
        """Next-token ids after feeding ``token`` ``[B]``, and the grown cache."""
        ...


@dataclass(frozen=True)
class DecodeSpeed(_Record):
    """Prefill latency, per-token decode latency and decode throughput of one input shape."""

    batch_size: int
    prompt_tokens: int
    new_tokens: int
    runs: int
    prefill_p50_ms: float
    prefill_p90_ms: float
    prefill_p99_ms: float
    decode_p50_ms: float
    decode_p90_ms: float
    decode_p99_ms: float
    decode_tokens_per_s: float


def measure_decode(
    runtime: DecodeRuntime,
    ids: np.ndarray,
    *,
    new_tokens: int,
    runs: int,
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
) -> DecodeSpeed:
    """Time ``runs`` greedy generations of ``new_tokens`` from ``ids`` after ``warmup`` untimed ones.

    Every prefill is one sample of the prefill latency; every decode step one sample of the per-token
    latency (a step yields one token per row, so decode tokens/s = batch / mean step time).
    """
    if runs < 1 or new_tokens < 1:
        raise ValueError(f"runs and new_tokens must be at least 1, got {runs} and {new_tokens}")
    prefill: list[float] = []
    steps: list[float] = []
    for i in range(warmup + runs):
        start = clock()
        token, state = runtime.prefill(ids)
        first = clock() - start
        timed: list[float] = []
        for _ in range(new_tokens - 1):
            start = clock()
            token, state = runtime.decode(token, state)
            timed.append(clock() - start)
        if i >= warmup:
            prefill.append(first)
            steps.extend(timed)
    pre = np.asarray(prefill) * 1e3
    dec = np.asarray(steps or [float("nan")]) * 1e3
    batch, prompt = ids.shape
    mean_step_s = float(np.mean(dec)) / 1e3
    return DecodeSpeed(
        batch_size=int(batch),
        prompt_tokens=int(prompt),
        new_tokens=new_tokens,
        runs=runs,
        prefill_p50_ms=float(np.percentile(pre, 50)),
        prefill_p90_ms=float(np.percentile(pre, 90)),
        prefill_p99_ms=float(np.percentile(pre, 99)),
        decode_p50_ms=float(np.percentile(dec, 50)),
        decode_p90_ms=float(np.percentile(dec, 90)),
        decode_p99_ms=float(np.percentile(dec, 99)),
        decode_tokens_per_s=batch / mean_step_s if mean_step_s > 0 else float("nan"),
    )


class TorchDecodeRuntime:
    """:class:`DecodeRuntime` over a Hugging Face causal LM (its own KV cache), greedy."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.device = next(model.parameters()).device

    def _next(self, out: Any) -> np.ndarray:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        return out.logits[:, -1].argmax(-1).cpu().numpy()

    def prefill(self, ids: np.ndarray) -> tuple[np.ndarray, Any]:
        import torch

        with torch.inference_mode():
            out = self.model(input_ids=torch.from_numpy(ids).to(self.device), use_cache=True)
        return self._next(out), out.past_key_values

    def decode(self, token: np.ndarray, state: Any) -> tuple[np.ndarray, Any]:
        import torch

        with torch.inference_mode():
            ids = torch.from_numpy(token[:, None]).to(self.device)
            out = self.model(input_ids=ids, past_key_values=state, use_cache=True)
        return self._next(out), out.past_key_values


class OrtDecodeRuntime:
    """:class:`DecodeRuntime` over an ONNX KV-cache decoder (``lmforge.onnx_runtime.OrtDecoderWithPast``)."""

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder

    def prefill(self, ids: np.ndarray) -> tuple[np.ndarray, Any]:
        mask = np.ones_like(ids)
        logits, past = self.decoder.step(ids, mask, self.decoder.empty_past(ids.shape[0]))
        return logits[:, -1].argmax(-1), (past, mask)

    def decode(self, token: np.ndarray, state: Any) -> tuple[np.ndarray, Any]:
        past, mask = state
        mask = np.concatenate([mask, np.ones((mask.shape[0], 1), dtype=mask.dtype)], axis=1)
        logits, past = self.decoder.step(token[:, None].astype(np.int64), mask, past)
        return logits[:, -1].argmax(-1), (past, mask)
