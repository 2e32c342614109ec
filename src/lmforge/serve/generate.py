"""Batched decoding with the KV-cache graph: prompts of any length in one batch, each row as if it ran alone.

Rows are left-padded to the longest prompt with attention mask 0 on the padding; the cache graph ``model.onnx`` derives
position ids from the mask (``cumsum(mask) - 1``), so a padded row sees the same positions and attends to the same
tokens as the unpadded prompt. After every step a finished row (EOS or its own ``max_tokens``) leaves the batch: its
cache rows are dropped, and mask columns that are padding in every remaining row are trimmed with the cache.

A row whose own work fails (its random generator or its sampling step raises) leaves the batch the same way, with
the error in its result: one request's failure never fails the other rows of its batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from lmforge.onnx_runtime import OrtDecoderWithPast

log = logging.getLogger("lmforge.serve")

TokenCallback = Callable[[int, int], None]
"""Called with (row index in the request list, token id) for each new token, EOS excluded."""


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt and how to continue it."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    """0 picks the most likely token (greedy); above 0 samples from the tempered distribution."""
    top_p: float = 1.0
    """Nucleus sampling: sample among the most likely tokens whose probabilities sum to ``top_p``."""
    seed: int | None = None


@dataclass
class GenerationResult:
    """The new tokens of one request (EOS excluded) and why decoding stopped: ``stop`` (EOS), ``length``, or
    ``error`` (then ``error`` holds what this request's own decoding raised)."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    error: Exception | None = None


def next_token(logits: np.ndarray, request: GenerationRequest, rng: np.random.Generator | None) -> int:
    """One token from last-position ``logits`` ``[vocab]``: argmax, or a tempered top-p sample."""
    if request.temperature <= 0.0 or rng is None:
        return int(logits.argmax())
    scaled = logits.astype(np.float64) / request.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    keep = order[: int(np.searchsorted(cumulative, request.top_p) + 1)]
    kept = probs[keep] / probs[keep].sum()
    return int(keep[rng.choice(len(keep), p=kept)])


def _failed(result: GenerationResult, index: int, size: int, exc: Exception) -> None:
    log.error("request %d of a batch of %d failed in decoding: %s: %s", index, size, type(exc).__name__, exc)
    result.finish_reason, result.error = "error", exc


def row_generators(
    requests: Sequence[GenerationRequest], results: list[GenerationResult]
) -> list[np.random.Generator | None]:
    """Each sampling request's random generator (``None`` when greedy); a request whose seed fails is marked failed."""
    rngs: list[np.random.Generator | None] = []
    for i, req in enumerate(requests):
        try:
            rngs.append(np.random.default_rng(req.seed) if req.temperature > 0.0 else None)
        except Exception as exc:  # this request fails alone; its row still runs the prefill, then leaves
            _failed(results[i], i, len(requests), exc)
            rngs.append(None)
    return rngs


def left_padded(requests: Sequence[GenerationRequest], pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompts as one batch, left-padded to the longest: ``(input_ids, attention_mask)``, int64."""
    longest = max(len(r.prompt_ids) for r in requests)
    ids = np.full((len(requests), longest), pad_token_id, dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, req in enumerate(requests):
        ids[i, longest - len(req.prompt_ids) :] = req.prompt_ids
        mask[i, longest - len(req.prompt_ids) :] = 1
    return ids, mask


def _sample(
    logits: np.ndarray,
    index: int,
    requests: Sequence[GenerationRequest],
    rngs: Sequence[np.random.Generator | None],
    results: list[GenerationResult],
) -> int | None:
    """Request ``index``'s next token from its last-position ``logits``; ``None`` once the request has failed."""
    if results[index].error is not None:
        return None
    with np.errstate(all="ignore"):  # a NaN from one row's sampling is that row's error, not a warning
        try:
            return next_token(logits, requests[index], rngs[index])
        except Exception as exc:  # one request's sampling fails alone; the other rows go on
            _failed(results[index], index, len(requests), exc)
            return None


def _accept(
    token: int,
    index: int,
    requests: Sequence[GenerationRequest],
    results: list[GenerationResult],
    eos_token_id: int | None,
    on_token: TokenCallback | None,
) -> bool:
    """Record request ``index``'s new ``token``; whether it goes on (not EOS, fewer than its ``max_tokens``)."""
    result = results[index]
    if eos_token_id is not None and token == eos_token_id:
        result.finish_reason = "stop"
        return False
    result.token_ids.append(token)
    if on_token is not None:
        on_token(index, token)
    return len(result.token_ids) < requests[index].max_tokens


def drop_rows(
    keep: list[int], tokens: np.ndarray, mask: np.ndarray, past: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Keep only the batch rows ``keep``, and trim the mask and cache columns that are padding in all of them."""
    tokens, mask, past = tokens[keep], mask[keep], [p[keep] for p in past]
    start = int(np.argmax(mask.any(axis=0)))  # leading columns that are padding in every row left
    if start:
        mask, past = mask[:, start:], [p[:, :, start:] for p in past]
    return tokens, mask, past


def generate_batch(
    decoder: OrtDecoderWithPast,
    requests: Sequence[GenerationRequest],
    *,
    eos_token_id: int | None,
    pad_token_id: int,
    on_token: TokenCallback | None = None,
) -> list[GenerationResult]:
    """Decode every request in one batch; results in the order of ``requests``."""
    if not requests:
        return []
    results = [GenerationResult() for _ in requests]
    rngs = row_generators(requests, results)
    ids, mask = left_padded(requests, pad_token_id)
    logits, past = decoder.step(ids, mask, decoder.empty_past(len(requests)))
    rows = list(range(len(requests)))  # request index of each batch row
    while True:
        tokens = np.zeros(len(rows), dtype=np.int64)
        keep = []
        for b, r in enumerate(rows):
            token = _sample(logits[b, -1], r, requests, rngs, results)
            if token is None:
                continue
            tokens[b] = token
            if _accept(token, r, requests, results, eos_token_id, on_token):
                keep.append(b)
        if not keep:
            return results
        if len(keep) < len(rows):
            rows = [rows[b] for b in keep]
            tokens, mask, past = drop_rows(keep, tokens, mask, past)
        mask = np.concatenate([mask, np.ones((len(rows), 1), dtype=np.int64)], axis=1)
        logits, past = decoder.step(tokens[:, None].astype(np.int64), mask, past)
