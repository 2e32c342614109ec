"""Held-out perplexity of any causal LM that maps token ids to next-token logits.

Method: the first ``max_tokens`` ids of a 1-D token array are cut into non-overlapping windows of
``context`` tokens (the last window may be shorter; one of a single token is dropped). Each window is
scored independently: position ``t`` (1 ≤ t < T) predicts token ``t`` from tokens ``0..t-1`` of the same
window, so the first token of every window is context only and is not scored. The negative
log-likelihoods ``-log softmax(logits[t-1])[token t]`` are summed in float64 over all windows, and

    mean_nll = nll_sum / tokens,   perplexity = exp(mean_nll),   bits_per_token = mean_nll / ln 2

where ``tokens`` is the number of scored positions. Non-overlapping windows understate what a model
would reach with a sliding window, but they are cheap and identical for every model compared, which is
what the evaluation needs. The same code scores PyTorch and ONNX Runtime models through a
:data:`LogitsFn` adapter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

LogitsFn = Callable[[np.ndarray], "np.ndarray | torch.Tensor"]
"""``ids (int64, [B, T]) -> logits ([B, T, V])``: one forward pass without KV cache."""


@dataclass(frozen=True)
class PerplexityResult:
    """Summed NLL over the scored tokens and the figures derived from it."""

    nll_sum: float
    tokens: int
    mean_nll: float
    perplexity: float

    @property
    def bits_per_token(self) -> float:
        """Mean NLL in bits."""
        return self.mean_nll / math.log(2)

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping (for JSON), including ``bits_per_token``."""
        return {**asdict(self), "bits_per_token": self.bits_per_token}


def windows(tokens: np.ndarray, *, context: int, max_tokens: int | None = None) -> list[np.ndarray]:
    """The non-overlapping windows scored by :func:`perplexity`, as int64 arrays."""
    if context < 2:
        raise ValueError(f"context must be at least 2 tokens, got {context}")
    flat = np.asarray(tokens).reshape(-1)
    if max_tokens is not None:
        flat = flat[:max_tokens]
    flat = flat.astype(np.int64)
    out = [flat[i : i + context] for i in range(0, flat.size, context)]
    return [w for w in out if w.size >= 2]


def _batches(wins: list[np.ndarray], batch_size: int) -> Iterator[np.ndarray]:
    """Stack equal-length windows into batches; a shorter last window goes alone."""
    full = [w for w in wins if w.size == wins[0].size]
    for i in range(0, len(full), batch_size):
        yield np.stack(full[i : i + batch_size])
    for w in wins[len(full) :]:
        yield w[None, :]


def perplexity(
    logits_fn: LogitsFn,
    tokens: np.ndarray,
    *,
    context: int,
    max_tokens: int | None = None,
    batch_size: int = 8,
) -> PerplexityResult:
    """Perplexity of ``logits_fn`` on ``tokens`` (method in the module docstring).

    Args:
        logits_fn: forward pass, ``ids [B, T] -> logits [B, T, V]``.
        tokens: 1-D token ids (any integer dtype, e.g. a uint16 memmap of a shard).
        context: window length in tokens (at most the model's maximum positions).
        max_tokens: score at most the first this many tokens.
        batch_size: windows per forward pass (does not change the result).
    """
    wins = windows(tokens, context=context, max_tokens=max_tokens)
    if not wins:
        raise ValueError("need at least 2 tokens to compute perplexity")
    nll_sum = 0.0
    scored = 0
    for ids in _batches(wins, batch_size):
        logits = torch.as_tensor(logits_fn(ids))
        if logits.ndim != 3 or tuple(logits.shape[:2]) != ids.shape:
            raise ValueError(f"logits_fn returned shape {tuple(logits.shape)} for ids of shape {ids.shape}")
        targets = torch.from_numpy(ids[:, 1:]).to(logits.device)
        # Row by row in float64: exact log-softmax without a [B, T, V] float64 copy of a large vocab.
        for row in range(ids.shape[0]):
            logp = torch.log_softmax(logits[row, :-1].double(), dim=-1)
            nll_sum -= float(logp.gather(-1, targets[row, :, None]).sum())
        scored += ids.shape[0] * (ids.shape[1] - 1)
    mean_nll = nll_sum / scored
    return PerplexityResult(nll_sum=nll_sum, tokens=scored, mean_nll=mean_nll, perplexity=math.exp(mean_nll))


def torch_logits_fn(model: PreTrainedModel | torch.nn.Module) -> LogitsFn:
    """Adapter for a PyTorch causal LM (HF ``model(input_ids).logits``), run under inference mode."""
    device = next(model.parameters()).device

    def fn(ids: np.ndarray) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(input_ids=torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(device))
            logits = logits.logits if hasattr(logits, "logits") else logits
        if device.type == "cuda":
            # Latency timing must include the kernel, not only its launch.
            torch.cuda.synchronize(device)
        return logits.float()

    return fn


def onnx_logits_fn(ort_model: Any) -> LogitsFn:
    """Adapter for :class:`lmforge.export.ort.OrtCausalLM` (or anything with ``logits(ids)``)."""

    def fn(ids: np.ndarray) -> np.ndarray:
        return ort_model.logits(np.ascontiguousarray(ids, dtype=np.int64))

    return fn
