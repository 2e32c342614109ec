"""Language-model batches cut from a flat token array.

A batch is ``{"input_ids": (B, T), "targets": (B, T)}`` of int64 with ``targets`` the inputs shifted
by one token; positions whose target is ``IGNORE_INDEX`` are not scored.

Training windows of optimizer step ``step`` are the ``G = batch_size × grad_accum × world_size``
windows whose start offsets a generator seeded from ``(seed, step)`` draws; micro-batch ``micro`` of
rank ``rank`` takes rows ``[(micro·world_size + rank)·B, … + B)`` of them. So the batch of any step is a
function of ``(seed, step, rank)`` only (resumption sees exactly the data an uninterrupted run would),
and the global batch of a step is the same set of windows however it is split over ranks and
accumulation steps (a 2-rank run matches a single process with twice the micro-batch).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.config import TrainConfig
from lmforge.data.tokenizer import tokenizer_fingerprint
from lmforge.errors import InputDataError
from lmforge.formats.token_shards import TokenShards

IGNORE_INDEX = -100


def batch_generator(seed: int, step: int, micro: int) -> torch.Generator:
    """A CPU generator whose state depends only on ``(seed, step, micro)``."""
    state = np.random.SeedSequence([seed, step, micro]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def _check_length(tokens: np.ndarray, seq_len: int, name: str) -> None:
    if len(tokens) < seq_len + 1:
        raise InputDataError(f"{name} split has {len(tokens)} tokens; need at least seq_len + 1 = {seq_len + 1}")


def _windows(tokens: np.ndarray, starts: torch.Tensor, seq_len: int) -> dict[str, torch.Tensor]:
    rows = np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts.tolist()])
    windows = torch.from_numpy(rows)
    return {"input_ids": windows[:, :-1], "targets": windows[:, 1:]}


def global_starts(n_tokens: int, *, seq_len: int, global_batch: int, seed: int, step: int) -> torch.Tensor:
    """Start offsets of the ``global_batch`` training windows of ``step``: uniform, from ``(seed, step)`` only."""
    generator = batch_generator(seed, step, 0)
    return torch.randint(0, n_tokens - seq_len, (global_batch,), generator=generator)


def random_windows(
    tokens: np.ndarray,
    *,
    batch_size: int,
    seq_len: int,
    seed: int,
    step: int,
    micro: int = 0,
    grad_accum: int = 1,
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s micro-batch ``micro`` of step ``step``: ``batch_size`` windows of the step's global batch."""
    _check_length(tokens, seq_len, "train")
    if not 0 <= micro < grad_accum or not 0 <= rank < world_size:
        raise ValueError(f"micro {micro} / rank {rank} out of range for grad_accum {grad_accum}, world {world_size}")
    starts = global_starts(
        len(tokens), seq_len=seq_len, global_batch=batch_size * grad_accum * world_size, seed=seed, step=step
    )
    first = (micro * world_size + rank) * batch_size
    return _windows(tokens, starts[first : first + batch_size], seq_len)


def eval_windows(tokens: np.ndarray, *, batch_size: int, seq_len: int, n_batches: int) -> list[dict[str, torch.Tensor]]:
    """``n_batches`` fixed batches of windows spread evenly over ``tokens`` (first window at 0)."""
    _check_length(tokens, seq_len, "val")
    count = batch_size * n_batches
    starts = torch.from_numpy(np.linspace(0, len(tokens) - seq_len - 1, count).astype(np.int64))
    return [_windows(tokens, starts[i : i + batch_size], seq_len) for i in range(0, count, batch_size)]


def collate(
    rows: list[tuple[list[int], list[int]]], pad_id: int, *, width: int | None = None
) -> dict[str, torch.Tensor]:
    """Encoded examples ``(ids, labels)`` as a loop batch: right-padded (labels ``IGNORE_INDEX`` on padding) to
    ``width`` tokens (default: the longest row), then shifted into inputs and targets."""
    width = width or max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for row, (example_ids, example_labels) in enumerate(rows):
        ids[row, : len(example_ids)] = torch.tensor(example_ids)
        labels[row, : len(example_labels)] = torch.tensor(example_labels)
    return {"input_ids": ids[:, :-1], "targets": labels[:, 1:]}


def open_matching_shards(shards_dir: str | Path, tokenizer_dir: str | Path) -> TokenShards:
    """Open token shards and check they were written by the tokenizer stored in ``tokenizer_dir``."""
    shards = TokenShards.open(shards_dir)
    expected = tokenizer_fingerprint(tokenizer_dir)
    if shards.tokenizer_sha256 != expected:
        raise InputDataError(
            f"token shards {shards_dir} were written by tokenizer {shards.tokenizer_sha256[:12]}, but "
            f"{tokenizer_dir} holds tokenizer {expected[:12]}; use the tokenizer from the same tokenize run"
        )
    return shards


def corpus_batches(
    tokens: np.ndarray, cfg: TrainConfig, *, rows: int, rank: int = 0, world_size: int = 1
) -> Callable[[int, int], dict[str, torch.Tensor]]:
    """``train_batch(step, micro)``: rank ``rank``'s ``rows`` training windows of ``tokens`` (see the module
    docstring), drawn with ``cfg``'s seed, window length and accumulation."""

    def train_batch(step: int, micro: int) -> dict[str, torch.Tensor]:
        return random_windows(
            tokens,
            batch_size=rows,
            seq_len=cfg.seq_len,
            seed=cfg.seed,
            step=step,
            micro=micro,
            grad_accum=cfg.grad_accum,
            rank=rank,
            world_size=world_size,
        )

    return train_batch


def val_batches(shards: TokenShards, cfg: TrainConfig) -> list[dict[str, torch.Tensor]]:
    """The evaluation batches of the val split: the same on every rank."""
    return eval_windows(
        shards.tokens("val"), batch_size=cfg.batch_size, seq_len=cfg.seq_len, n_batches=cfg.eval_batches
    )


def shard_batches(
    shards: TokenShards, cfg: TrainConfig, *, rank: int = 0, world_size: int = 1
) -> tuple[Callable[[int, int], dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """``(train_batch(step, micro), eval batches)`` over the train and val splits of ``shards``.

    ``train_batch`` returns rank ``rank``'s part of the step's global batch (see the module docstring);
    every rank gets the same evaluation batches.
    """
    train_tokens = shards.tokens("train")
    val = val_batches(shards, cfg)
    _check_length(train_tokens, cfg.seq_len, "train")
    return corpus_batches(train_tokens, cfg, rows=cfg.batch_size, rank=rank, world_size=world_size), val


class Prefetcher:
    """Yield ``make(step, micro)`` for every micro-batch from ``start_step`` on, built ahead in a thread.

    The batches and their order are exactly those of calling ``make`` in the loop, so the data stays a
    function of ``(seed, step, micro, rank)``; only the time they are built moves. ``depth`` batches are
    kept ready (0 builds each one on demand, in the caller's thread). ``make`` must not share mutable
    state with the training step. An exception in ``make`` is raised by :meth:`next` in the caller.
    Tensors are pinned when ``pin`` is set, so the copy to a GPU can run asynchronously.
    """

    _DONE = object()

    def __init__(
        self,
        make: Callable[[int, int], Any],
        *,
        start_step: int,
        max_steps: int,
        grad_accum: int,
        depth: int,
        pin: bool = False,
    ) -> None:
        self._make = make
        self._pin = pin
        self._order = ((step, micro) for step in range(start_step, max_steps) for micro in range(grad_accum))
        self._stop = threading.Event()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(depth, 1))
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._thread = threading.Thread(target=self._fill, name="lmforge-prefetch", daemon=True)
            self._thread.start()

    def _build(self, step: int, micro: int) -> Any:
        batch = self._make(step, micro)
        return map_tensors(batch, torch.Tensor.pin_memory) if self._pin else batch

    def _fill(self) -> None:
        try:
            for step, micro in self._order:
                item = (step, micro, self._build(step, micro))
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as error:  # handed to the consumer, which re-raises it
            self._queue.put(error)
            return
        self._queue.put(self._DONE)

    def next(self, step: int, micro: int) -> Any:
        """The batch of ``(step, micro)``; calls must follow the order the batches are built in."""
        if self._thread is None:
            return self._build(step, micro)
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        if item is self._DONE or item[:2] != (step, micro):
            raise RuntimeError(f"prefetcher out of order: asked for step {step} micro {micro}, had {item!r:.80}")
        return item[2]

    def close(self) -> None:
        """Stop the background thread (batches built ahead are dropped)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` (a tensor, or a mapping, list or tuple of them, nested) with ``fn`` applied to every tensor."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch
