"""Held-out perplexity and bits per byte of any causal LM that maps token ids to next-token logits.

Method (rolling log-likelihood with a sliding window). Let ``x`` be the scored token stream: the
held-out ids, optionally preceded by a ``prefix`` token (the EOS that separates documents, as
lm-evaluation-harness prepends its end-of-text token) so that the first real token is scored too.
Every target ``x[t]`` (``t ≥ 1``) is scored exactly once, from the logits of one forward pass over at
most ``context`` tokens. The passes end at::

    end_0 = min(context, n - 1),   end_{k+1} = min(end_k + stride, n - 1)

and pass ``k`` feeds ``x[max(0, end_k - context) : end_k]`` and scores the targets
``x[end_{k-1} + 1 .. end_k]`` (``end_{-1} = 0``). So the first pass scores ``context`` tokens with
1..context tokens of history, every later pass scores ``stride`` new tokens with at least
``context - stride + 1`` tokens of history, and the last pass is aligned to the end of the text (full
history, fewer new targets). With ``stride == context`` the passes do not overlap: this is exactly
lm-evaluation-harness's ``loglikelihood_rolling`` (``get_rolling_token_windows`` with
``max_seq_len=context, context_len=1`` followed by ``make_disjoint_window``); a general stride is the
same function with ``context_len = context - stride + 1``. A smaller stride gives every token more
history (lower perplexity) at ``context / stride`` times the compute.

The negative log-likelihoods ``-log softmax(logits)[target]`` are summed in float64::

    mean_nll = nll_sum / tokens,  perplexity = exp(mean_nll),  bits_per_token = mean_nll / ln 2,
    bits_per_byte = nll_sum / (ln 2 · bytes)

where ``bytes`` is the UTF-8 length of the scored text (special tokens such as EOS are scored but
carry no bytes). Bits per byte does not depend on the tokenizer, so it compares models with different
vocabularies (a retrained candidate against production). The same code scores PyTorch and ONNX
Runtime models through a :data:`LogitsFn` adapter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

LogitsFn = Callable[[np.ndarray], "np.ndarray | torch.Tensor"]
"""``ids (int64, [B, T]) -> logits ([B, T, V])``: one forward pass without KV cache."""


@dataclass(frozen=True)
class PerplexityResult:
    """Summed NLL over the scored tokens and the figures derived from it."""

    nll_sum: float
    tokens: int
    mean_nll: float
    perplexity: float
    context: int
    stride: int
    bytes: int | None = None

    @property
    def bits_per_token(self) -> float:
        """Mean NLL in bits."""
        return self.mean_nll / math.log(2)

    @property
    def bits_per_byte(self) -> float | None:
        """Summed NLL in bits divided by the UTF-8 bytes of the scored text; ``None`` when unknown."""
        if not self.bytes:
            return None
        return self.nll_sum / (math.log(2) * self.bytes)

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping (for JSON), including ``bits_per_token`` and ``bits_per_byte``."""
        return {**asdict(self), "bits_per_token": self.bits_per_token, "bits_per_byte": self.bits_per_byte}


@dataclass(frozen=True)
class Window:
    """One forward pass: ``ids`` are fed; the logits at positions ``first ..`` predict ``targets``."""

    ids: np.ndarray
    targets: np.ndarray
    first: int


def stream(tokens: np.ndarray, *, max_tokens: int | None = None, prefix: int | None = None) -> np.ndarray:
    """The int64 stream that :func:`windows` cuts: ``[prefix] + tokens[:max_tokens]``."""
    flat = np.asarray(tokens).reshape(-1)
    if max_tokens is not None:
        flat = flat[:max_tokens]
    flat = flat.astype(np.int64)
    if prefix is not None:
        flat = np.concatenate([np.array([prefix], dtype=np.int64), flat])
    return flat


def windows(
    tokens: np.ndarray,
    *,
    context: int,
    stride: int | None = None,
    max_tokens: int | None = None,
    prefix: int | None = None,
) -> list[Window]:
    """The forward passes scored by :func:`perplexity` (method in the module docstring)."""
    stride = context if stride is None else stride
    if context < 1:
        raise ValueError(f"context must be at least 1 token, got {context}")
    if not 1 <= stride <= context:
        raise ValueError(f"stride must be between 1 and context ({context}), got {stride}")
    x = stream(tokens, max_tokens=max_tokens, prefix=prefix)
    last = x.size - 1  # index of the last target
    out: list[Window] = []
    prev, end = 0, min(context, last)
    while prev < last:
        start = max(0, end - context)
        ids = x[start:end]
        out.append(Window(ids=ids, targets=x[prev + 1 : end + 1], first=prev - start))
        prev, end = end, min(end + stride, last)
    return out


def _batches(wins: list[Window], batch_size: int) -> Iterator[list[Window]]:
    """Group windows of equal input length (all but a text shorter than the context are full)."""
    by_length: dict[int, list[Window]] = {}
    for w in wins:
        by_length.setdefault(w.ids.size, []).append(w)
    for group in by_length.values():
        for i in range(0, len(group), batch_size):
            yield group[i : i + batch_size]


def perplexity(
    logits_fn: LogitsFn,
    tokens: np.ndarray,
    *,
    context: int,
    stride: int | None = None,
    max_tokens: int | None = None,
    prefix: int | None = None,
    byte_count: int | None = None,
    batch_size: int = 8,
) -> PerplexityResult:
    """Perplexity of ``logits_fn`` on ``tokens`` (method in the module docstring).

    Args:
        logits_fn: forward pass, ``ids [B, T] -> logits [B, T, V]``.
        tokens: 1-D token ids (any integer dtype, e.g. a uint16 memmap of a shard).
        context: tokens per forward pass (at most the model's maximum positions).
        stride: new targets per pass after the first; ``None`` means ``context`` (non-overlapping).
        max_tokens: score at most the first this many tokens.
        prefix: a token id put before the text so that its first token is scored (e.g. EOS).
        byte_count: UTF-8 bytes of the scored text (see :func:`scored_bytes`), for bits per byte.
        batch_size: windows per forward pass (does not change the result).
    """
    stride = context if stride is None else stride
    wins = windows(tokens, context=context, stride=stride, max_tokens=max_tokens, prefix=prefix)
    if not wins:
        raise ValueError("need at least 2 tokens (or 1 and a prefix) to compute perplexity")
    nll_sum = 0.0
    scored = 0
    for group in _batches(wins, batch_size):
        ids = np.stack([w.ids for w in group])
        logits = torch.as_tensor(logits_fn(ids))
        if logits.ndim != 3 or tuple(logits.shape[:2]) != ids.shape:
            raise ValueError(f"logits_fn returned shape {tuple(logits.shape)} for ids of shape {ids.shape}")
        # Row by row in float64, only at scored positions: exact log-softmax without a [B, T, V] float64 copy.
        for row, w in enumerate(group):
            logp = torch.log_softmax(logits[row, w.first :].double(), dim=-1)
            targets = torch.from_numpy(w.targets).to(logp.device)
            nll_sum -= float(logp.gather(-1, targets[:, None]).sum())
            scored += w.targets.size
    mean_nll = nll_sum / scored
    return PerplexityResult(
        nll_sum=nll_sum,
        tokens=scored,
        mean_nll=mean_nll,
        perplexity=math.exp(mean_nll),
        context=context,
        stride=stride,
        bytes=byte_count,
    )


def scored_ids(tokens: np.ndarray, *, max_tokens: int | None = None, prefix: int | None = None) -> np.ndarray:
    """The ids that :func:`perplexity` scores: every token of the stream but its first."""
    return stream(tokens, max_tokens=max_tokens, prefix=prefix)[1:]


def _is_byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and isinstance(backend.decoder, decoders.ByteLevel)


def scored_bytes(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int] | np.ndarray) -> int:
    """UTF-8 bytes of the text behind ``ids``; special tokens (EOS, padding) count zero.

    For a byte-level BPE every character of a token's string stands for exactly one byte, so the
    count is exact even when a window boundary splits a multi-byte character; other tokenizers are
    decoded and the text's UTF-8 length is taken.
    """
    special = set(tokenizer.all_special_ids)
    kept = [int(i) for i in np.asarray(ids).reshape(-1) if int(i) not in special]
    if _is_byte_level(tokenizer):
        return sum(len(piece) for piece in tokenizer.convert_ids_to_tokens(kept))
    return len(tokenizer.decode(kept, clean_up_tokenization_spaces=False).encode("utf-8"))


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
    """Adapter for :class:`lmforge.onnx_runtime.OrtCausalLM` (or anything with ``logits(ids)``)."""

    def fn(ids: np.ndarray) -> np.ndarray:
        return ort_model.logits(np.ascontiguousarray(ids, dtype=np.int64))

    return fn
