"""Request-level dynamic batching: requests that arrive together are decoded together.

A request waits in a queue; the scheduler takes the oldest, then up to ``max_batch_size - 1`` more, waiting at
most ``max_wait_ms`` after the oldest one arrived, and decodes the batch in a worker thread (ONNX Runtime releases
the GIL, so the event loop keeps accepting requests meanwhile). One batch runs at a time; requests that arrive
during it form the next one. A streaming request gets every new token on its event queue at once. A request
whose client went away is still decoded to its end (at most ``max_tokens``).

A request with several prompts first reserves a place in the queue for all of them (:meth:`DynamicBatcher.reserve`):
refused whole, before any prompt is tokenized, when they cannot all wait; its prompts then go in together.
A request whose own decoding failed gets its error; the others of its batch get their results.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from lmforge.errors import LmforgeError
from lmforge.serve.generate import GenerationRequest, GenerationResult, TokenCallback

log = logging.getLogger("lmforge.serve")

BatchRunner = Callable[[Sequence[GenerationRequest], TokenCallback], list[GenerationResult]]


class QueueFullError(LmforgeError):
    """The predictor's queue holds ``max_queue`` requests already; the client should retry later."""


@dataclass(frozen=True)
class TokenEvent:
    """A new token of a request."""

    token_id: int


@dataclass(frozen=True)
class DoneEvent:
    """The request finished: its result and the size of the batch it was decoded in."""

    result: GenerationResult
    batch_size: int


@dataclass(frozen=True)
class ErrorEvent:
    """Decoding the request (or its whole batch) failed."""

    error: BaseException


Event = TokenEvent | DoneEvent | ErrorEvent


@dataclass
class _Pending:
    request: GenerationRequest
    events: asyncio.Queue[Event]
    stream: bool
    enqueued: float = field(default_factory=time.monotonic)


@dataclass
class BatchStats:
    """What the scheduler has run so far."""

    batches: int = 0
    requests: int = 0
    largest_batch: int = 0
    batch_sizes: collections.Counter[int] = field(default_factory=collections.Counter)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready counters: ``batch_sizes`` maps a batch size to how many batches had it."""
        return {
            "batches": self.batches,
            "requests": self.requests,
            "largest_batch": self.largest_batch,
            "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
        }


class DynamicBatcher:
    """Queue requests and decode them in batches of up to ``max_batch_size`` with ``run_batch``.

    Args:
        run_batch: decodes a list of requests, calling its callback with (index, token) per new token.
        max_batch_size: most requests per batch (1: every request alone, in arrival order).
        max_wait_ms: how long the oldest queued request waits for company.
        max_queue: most requests waiting; :meth:`submit` raises :class:`QueueFullError` beyond.
    """

    def __init__(self, run_batch: BatchRunner, *, max_batch_size: int, max_wait_ms: float, max_queue: int) -> None:
        self.run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_queue = max_queue
        self.stats = BatchStats()
        self._queue: collections.deque[_Pending] = collections.deque()
        self._reserved = 0
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmforge-decode")

    @contextmanager
    def reserve(self, count: int) -> Iterator[Reservation]:
        """Hold ``count`` places in the queue, or raise :class:`QueueFullError` at once (nothing is queued).

        Requests submitted through the reservation take its places; those it still holds are freed on exit.
        """
        waiting = len(self._queue) + self._reserved
        if waiting + count > self.max_queue:
            raise QueueFullError(
                f"{waiting} requests are waiting and this one brings {count} (serve.max_queue is {self.max_queue}); "
                "retry later"
            )
        reservation = Reservation(self, count)
        self._reserved += count
        try:
            yield reservation
        finally:
            self._reserved -= reservation.left

    def submit(self, request: GenerationRequest, *, stream: bool = False) -> asyncio.Queue[Event]:
        """Queue ``request`` (one place: see :meth:`reserve`); a :class:`DoneEvent` (or an :class:`ErrorEvent`)
        arrives on the returned queue, after a :class:`TokenEvent` per new token if ``stream`` (only then: each one
        wakes the event loop).

        Must be called from the event loop that serves the requests; the scheduler starts on the first call.
        """
        with self.reserve(1) as reservation:
            return reservation.submit(request, stream=stream)

    def _enqueue(self, request: GenerationRequest, stream: bool) -> asyncio.Queue[Event]:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._schedule(), name="lmforge-batcher")
        pending = _Pending(request, asyncio.Queue(), stream)
        self._queue.append(pending)
        assert self._wakeup is not None
        self._wakeup.set()
        return pending.events

    async def _next_batch(self) -> list[_Pending]:
        assert self._wakeup is not None
        while not self._queue:
            self._wakeup.clear()
            await self._wakeup.wait()
        deadline = self._queue[0].enqueued + self.max_wait_s
        while len(self._queue) < self.max_batch_size and (left := deadline - time.monotonic()) > 0:
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout=left)
            except TimeoutError:
                break
        return [self._queue.popleft() for _ in range(min(self.max_batch_size, len(self._queue)))]

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            size = len(batch)
            self.stats.batches += 1
            self.stats.requests += size
            self.stats.largest_batch = max(self.stats.largest_batch, size)
            self.stats.batch_sizes[size] += 1

            def on_token(index: int, token: int, batch: list[_Pending] = batch) -> None:
                if batch[index].stream:
                    loop.call_soon_threadsafe(batch[index].events.put_nowait, TokenEvent(token))

            try:
                results = await loop.run_in_executor(
                    self._executor, self.run_batch, [p.request for p in batch], on_token
                )
            except Exception as exc:  # every request of the batch gets the error; the scheduler keeps serving
                log.exception("decoding a batch of %d failed", size)
                for pending in batch:
                    pending.events.put_nowait(ErrorEvent(exc))
                continue
            for pending, result in zip(batch, results, strict=True):
                pending.events.put_nowait(ErrorEvent(result.error) if result.error else DoneEvent(result, size))

    def close(self) -> None:
        """Stop the scheduler and the decoding thread (requests still queued get no answer)."""
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)


class Reservation:
    """Places held in a :class:`DynamicBatcher`'s queue (see :meth:`DynamicBatcher.reserve`)."""

    def __init__(self, batcher: DynamicBatcher, count: int) -> None:
        self._batcher = batcher
        self.left = count

    def submit(self, request: GenerationRequest, *, stream: bool = False) -> asyncio.Queue[Event]:
        """Queue ``request`` in one of the held places; its events arrive on the returned queue."""
        if self.left < 1:
            raise LmforgeError("this reservation holds no place left; reserve one per request")
        self.left -= 1
        self._batcher._reserved -= 1
        return self._batcher._enqueue(request, stream)
