"""Batched decoding with the KV-cache graph: prompts of any length in one batch, each row as if it ran alone.

Rows are left-padded to the longest prompt with attention mask 0 on the padding; ``decoder_with_past.onnx`` derives
position ids from the mask (``cumsum(mask) - 1``), so a padded row sees the same positions and attends to the same
tokens as the unpadded prompt. After every step a finished row (EOS or its own ``max_tokens``) leaves the batch: its
cache rows are dropped, and mask columns that are padding in every remaining row are trimmed with the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from lmforge.onnx_runtime import OrtDecoderWithPast

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
    """The new tokens of one request (EOS excluded) and why decoding stopped: ``stop`` (EOS) or ``length``."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"


def next_tokens(
    logits: np.ndarray, requests: Sequence[GenerationRequest], rngs: Sequence[np.random.Generator | None]
) -> np.ndarray:
    """One token per row from last-position ``logits`` ``[rows, vocab]``: argmax, or a tempered top-p sample."""
    tokens = logits.argmax(-1)
    for i, (req, rng) in enumerate(zip(requests, rngs, strict=True)):
        if req.temperature <= 0.0 or rng is None:
            continue
        scaled = logits[i].astype(np.float64) / req.temperature
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cumulative, req.top_p) + 1)]
        kept = probs[keep] / probs[keep].sum()
        tokens[i] = keep[rng.choice(len(keep), p=kept)]
    return tokens


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
    rngs = [np.random.default_rng(r.seed) if r.temperature > 0.0 else None for r in requests]
    longest = max(len(r.prompt_ids) for r in requests)
    ids = np.full((len(requests), longest), pad_token_id, dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, req in enumerate(requests):
        ids[i, longest - len(req.prompt_ids) :] = req.prompt_ids
        mask[i, longest - len(req.prompt_ids) :] = 1
    logits, past = decoder.step(ids, mask, decoder.empty_past(len(requests)))
    rows = list(range(len(requests)))  # request index of each batch row
    while True:
        tokens = next_tokens(logits[:, -1], [requests[r] for r in rows], [rngs[r] for r in rows])
        keep = []
        for b, r in enumerate(rows):
            token = int(tokens[b])
            if eos_token_id is not None and token == eos_token_id:
                results[r].finish_reason = "stop"
                continue
            results[r].token_ids.append(token)
            if on_token is not None:
                on_token(r, token)
            if len(results[r].token_ids) < requests[r].max_tokens:
                keep.append(b)
        if not keep:
            return results
        if len(keep) < len(rows):
            rows = [rows[b] for b in keep]
            tokens, mask, past = tokens[keep], mask[keep], [p[keep] for p in past]
            start = int(np.argmax(mask.any(axis=0)))  # leading columns that are padding in every row left
            if start:
                mask, past = mask[:, start:], [p[:, :, start:] for p in past]
        mask = np.concatenate([mask, np.ones((len(rows), 1), dtype=np.int64)], axis=1)
        logits, past = decoder.step(tokens[:, None].astype(np.int64), mask, past)
