"""Batched decoding with the KV-cache graph: prompts of any length in one batch, each row as if it ran alone.

:class:`RunningBatch` decodes a step at a time and takes new requests between steps (continuous batching);
:func:`generate_batch` runs one group of requests to its end.

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
import onnxruntime as ort

from lmforge.onnx_runtime import OrtDecoderWithPast, cache_arrays

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


def row_generator(
    request: GenerationRequest, result: GenerationResult, key: int, size: int
) -> np.random.Generator | None:
    """The request's random generator (``None`` when greedy); a request whose seed fails is marked failed."""
    try:
        return np.random.default_rng(request.seed) if request.temperature > 0.0 else None
    except Exception as exc:  # this request fails alone; its row still runs the prefill, then leaves
        _failed(result, key, size, exc)
        return None


def left_padded(requests: Sequence[GenerationRequest], pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompts as one batch, left-padded to the longest: ``(input_ids, attention_mask)``, int64."""
    longest = max(len(r.prompt_ids) for r in requests)
    ids = np.full((len(requests), longest), pad_token_id, dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, req in enumerate(requests):
        ids[i, longest - len(req.prompt_ids) :] = req.prompt_ids
        mask[i, longest - len(req.prompt_ids) :] = 1
    return ids, mask


def drop_rows(
    keep: list[int], tokens: np.ndarray, mask: np.ndarray, past: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Keep only the batch rows ``keep``, and trim the mask and cache columns that are padding in all of them."""
    tokens, mask, past = tokens[keep], mask[keep], [p[keep] for p in past]
    start = int(np.argmax(mask.any(axis=0)))  # leading columns that are padding in every row left
    if start:
        mask, past = mask[:, start:], [p[:, :, start:] for p in past]
    return tokens, mask, past


def _left_pad(mask: np.ndarray, past: list[np.ndarray], length: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """``mask`` and ``past`` padded on the left (mask 0, zero cache) to ``length`` positions."""
    extra = length - mask.shape[1]
    if not extra:
        return mask, past
    return np.pad(mask, ((0, 0), (extra, 0))), [np.pad(p, ((0, 0), (0, 0), (extra, 0), (0, 0))) for p in past]


@dataclass
class _Row:
    """A request in the running batch: its key for the callback, its result so far and its random generator."""

    key: int
    request: GenerationRequest
    result: GenerationResult
    rng: np.random.Generator | None
    batch_size: int
    """Rows in the batch when this one joined (what a failure's log line names)."""


Finished = list[tuple[int, GenerationResult]]
"""The key and the result of each request that left the batch."""


class RunningBatch:
    """Rows decoding together, one token each per :meth:`step`; requests join (:meth:`admit`) between steps.

    The batch holds each row's next input token, the attention mask of what its cache holds, and the cache. A joining
    group is prefilled alone, then its rows and the running ones are left-padded to the longer cache and stacked: a
    padded row sees the same positions (derived from the mask) and attends to the same tokens as alone. A row leaves
    as soon as it finishes.

    Args:
        decoder: the KV-cache graph's session.
        eos_token_id: the token that ends a row (``None``: only ``max_tokens`` does).
        pad_token_id: the token of the prompts' left padding.
        on_token: called with (key, token id) for each new token, EOS excluded.
    """

    def __init__(
        self,
        decoder: OrtDecoderWithPast,
        *,
        eos_token_id: int | None,
        pad_token_id: int,
        on_token: TokenCallback | None = None,
    ) -> None:
        self.decoder = decoder
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.on_token = on_token
        self._empty()

    def _empty(self) -> None:
        """No rows, no cache."""
        self.rows: list[_Row] = []
        self.tokens = np.zeros(0, dtype=np.int64)
        self.mask = np.zeros((0, 0), dtype=np.int64)
        self.past: list[np.ndarray] | list[ort.OrtValue] = self.decoder.empty_past(0)

    def __len__(self) -> int:
        return len(self.rows)

    def admit(self, requests: Sequence[GenerationRequest], keys: Sequence[int]) -> Finished:
        """Prefill ``requests`` (callback keys ``keys``) and add them to the batch; returns those done already."""
        size = len(self.rows) + len(requests)
        rows = [_Row(k, r, GenerationResult(), None, size) for k, r in zip(keys, requests, strict=True)]
        for row in rows:
            row.rng = row_generator(row.request, row.result, row.key, size)
        ids, mask = left_padded(requests, self.pad_token_id)
        logits, past = self.decoder.step_bound(ids, mask, self.decoder.empty_past(len(rows)))
        tokens, keep, finished = self._advance(rows, logits)
        if not keep:
            return finished
        if not self.rows and len(keep) == len(rows):
            self.rows, self.tokens, self.mask, self.past = rows, tokens, mask, past
            return finished
        tokens, mask, past = drop_rows(keep, tokens, mask, cache_arrays(past))
        length = max(mask.shape[1], self.mask.shape[1])
        old_mask, old_past = _left_pad(self.mask, cache_arrays(self.past), length)
        new_mask, new_past = _left_pad(mask, past, length)
        self.rows += [rows[b] for b in keep]
        self.tokens = np.concatenate([self.tokens, tokens])
        self.mask = np.concatenate([old_mask, new_mask])
        self.past = [np.concatenate(pair) for pair in zip(old_past, new_past, strict=True)]
        return finished

    def step(self) -> Finished:
        """Decode one token for every row; returns the rows that finished with it (they left the batch)."""
        mask = np.concatenate([self.mask, np.ones((len(self.rows), 1), dtype=np.int64)], axis=1)
        logits, past = self.decoder.step_bound(self.tokens[:, None], mask, self.past)
        tokens, keep, finished = self._advance(self.rows, logits)
        if not keep:
            self._empty()
        elif len(keep) < len(self.rows):
            self.rows = [self.rows[b] for b in keep]
            self.tokens, self.mask, self.past = drop_rows(keep, tokens, mask, cache_arrays(past))
        else:
            self.tokens, self.mask, self.past = tokens, mask, past
        return finished

    def _advance(self, rows: list[_Row], logits: np.ndarray) -> tuple[np.ndarray, list[int], Finished]:
        """Each row's next token from its last-position logits: (tokens, the rows that go on, those finished)."""
        tokens = np.zeros(len(rows), dtype=np.int64)
        keep: list[int] = []
        finished: Finished = []
        for b, row in enumerate(rows):
            token = self._sample(row, logits[b, -1])
            if token is not None:
                tokens[b] = token
                if self._accept(row, token):
                    keep.append(b)
                    continue
            finished.append((row.key, row.result))
        return tokens, keep, finished

    def _sample(self, row: _Row, logits: np.ndarray) -> int | None:
        """The row's next token; ``None`` once the row has failed."""
        if row.result.error is not None:
            return None
        with np.errstate(all="ignore"):  # a NaN from one row's sampling is that row's error, not a warning
            try:
                return next_token(logits, row.request, row.rng)
            except Exception as exc:  # one request's sampling fails alone; the other rows go on
                _failed(row.result, row.key, row.batch_size, exc)
                return None

    def _accept(self, row: _Row, token: int) -> bool:
        """Record the row's new ``token``; whether it goes on (not EOS, fewer than its ``max_tokens``)."""
        if self.eos_token_id is not None and token == self.eos_token_id:
            row.result.finish_reason = "stop"
            return False
        row.result.token_ids.append(token)
        if self.on_token is not None:
            self.on_token(row.key, token)
        return len(row.result.token_ids) < row.request.max_tokens


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
    batch = RunningBatch(decoder, eos_token_id=eos_token_id, pad_token_id=pad_token_id, on_token=on_token)
    results: dict[int, GenerationResult] = dict(batch.admit(requests, range(len(requests))))
    while batch:
        results.update(batch.step())
    return [results[i] for i in range(len(requests))]
