"""Forward-pass latency of any :data:`~lmforge.evaluate.perplexity.LogitsFn`.

A fixed input of ``batch_size × context`` held-out tokens is run ``warmup`` times untimed (allocator,
thread pools, lazy initialization), then ``runs`` times timed, one full forward pass without KV cache
each. Reported: p50/p90/p99 and mean milliseconds per pass, and tokens/s = ``B·T`` / mean seconds.
Numbers from a shared CI machine are indicative only; the gate's threshold is meant for the serving
hardware.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from lmforge.evaluate.perplexity import LogitsFn

DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 8)


@dataclass(frozen=True)
class LatencyResult:
    """Latency statistics of one input shape."""

    batch_size: int
    context: int
    runs: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    tokens_per_s: float

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping (for JSON)."""
        return asdict(self)


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
