"""Request-level batching: requests that arrive together are decoded together.

A request waits in a queue. :class:`ContinuousBatcher` (what the predictor runs) decodes one running batch, a step
at a time, in a worker thread (ONNX Runtime releases the GIL, so the event loop keeps accepting requests meanwhile):
requests queued while it runs join it at the next step, up to ``max_batch_size`` rows, and a row leaves as soon as it
finishes, so a short request never waits for a long one. :class:`DynamicBatcher` decodes batch after batch with any
:data:`BatchRunner`: a request queued during a batch waits for it to finish. Either one, when idle, takes the oldest
request and waits at most ``max_wait_ms`` after it arrived for up to ``max_batch_size - 1`` more. A streaming request
gets every new token on its event queue at once. A request whose client went away is still decoded to its end (at
most ``max_tokens``).

A request with several prompts first reserves a place in the queue for all of them (:meth:`Batcher.reserve`):
refused whole, before any prompt is tokenized, when they cannot all wait; its prompts then go in together.
A request whose own decoding failed gets its error; the others of its batch get their results.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import concurrent.futures
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from lmforge.errors import LmforgeError
from lmforge.serve.generate import Finished, GenerationRequest, GenerationResult, RunningBatch, TokenCallback

log = logging.getLogger("lmforge.serve")

BatchRunner = Callable[[Sequence[GenerationRequest], TokenCallback], list[GenerationResult]]
"""Decodes a list of requests, calling its callback with (index, token) per new token."""
NewBatch = Callable[[TokenCallback], RunningBatch]
"""An empty running batch whose rows report each new token to the callback (with their key)."""


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
    batch_size: int = 0
    """Rows in the running batch when this request joined it (:class:`ContinuousBatcher`)."""


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


class Batcher(abc.ABC):
    """The queue the batchers share: places, reservations, and the wait for company.

    Args:
        max_batch_size: most requests per batch (1: every request alone, in arrival order).
        max_wait_ms: how long the oldest queued request waits for company.
        max_queue: most requests waiting; :meth:`submit` raises :class:`QueueFullError` beyond.
    """

    def __init__(self, *, max_batch_size: int, max_wait_ms: float, max_queue: int) -> None:
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

    @abc.abstractmethod
    async def _schedule(self) -> None:
        """Decode the queued requests, forever (the task :meth:`submit` starts)."""

    def _count(self, joining: int, size: int) -> None:
        """Count a batch (or a group joining one) of ``joining`` requests, ``size`` rows in all."""
        self.stats.batches += 1
        self.stats.requests += joining
        self.stats.largest_batch = max(self.stats.largest_batch, size)
        self.stats.batch_sizes[size] += 1

    def close(self) -> None:
        """Stop the scheduler and the decoding thread (requests still queued get no answer)."""
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)


class DynamicBatcher(Batcher):
    """Queue requests and decode them batch after batch, each of up to ``max_batch_size``, with ``run_batch``.

    Args:
        run_batch: decodes a list of requests (see :data:`BatchRunner`).
        max_batch_size, max_wait_ms, max_queue: see :class:`Batcher`.
    """

    def __init__(self, run_batch: BatchRunner, *, max_batch_size: int, max_wait_ms: float, max_queue: int) -> None:
        super().__init__(max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, max_queue=max_queue)
        self.run_batch = run_batch

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            size = len(batch)
            self._count(size, size)

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


class ContinuousBatcher(Batcher):
    """Queue requests and decode them in one running batch that they join between steps (see the module).

    ``stats`` counts each group that joins as a batch, its size the rows decoding once it joined.

    Args:
        new_batch: makes the running batch (see :data:`NewBatch`).
        max_batch_size, max_wait_ms, max_queue: see :class:`Batcher`.
    """

    def __init__(self, new_batch: NewBatch, *, max_batch_size: int, max_wait_ms: float, max_queue: int) -> None:
        super().__init__(max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, max_queue=max_queue)
        self.new_batch = new_batch

    def _joining(self, running: int) -> list[_Pending]:
        """The queued requests that fit in the running batch beside its ``running`` rows."""
        return [self._queue.popleft() for _ in range(min(self.max_batch_size - running, len(self._queue)))]

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        members: dict[int, _Pending] = {}  # the running batch's requests by key; changed only between decode calls
        keys = itertools.count()

        def on_token(key: int, token: int) -> None:
            if members[key].stream:
                loop.call_soon_threadsafe(members[key].events.put_nowait, TokenEvent(token))

        def finish(finished: Finished) -> None:
            for key, result in finished:
                pending = members.pop(key)
                event = ErrorEvent(result.error) if result.error else DoneEvent(result, pending.batch_size)
                loop.call_soon_threadsafe(pending.events.put_nowait, event)

        batch = self.new_batch(on_token)
        while True:
            joining = self._joining(len(batch)) if batch else await self._next_batch()
            size = len(batch) + len(joining)
            self._count(len(joining), size)
            joined = {next(keys): pending for pending in joining}
            for pending in joining:
                pending.batch_size = size
            members.update(joined)
            try:
                await loop.run_in_executor(self._executor, self._decode, batch, joined, finish)
            except Exception as exc:  # every request of the batch gets the error; the scheduler keeps serving
                log.exception("decoding a batch of %d failed", len(members))
                for pending in members.values():
                    pending.events.put_nowait(ErrorEvent(exc))
                members.clear()
                batch = self.new_batch(on_token)

    def _decode(self, batch: RunningBatch, joined: dict[int, _Pending], finish: Callable[[Finished], None]) -> None:
        """In the worker thread: admit ``joined``, then step until the batch empties or queued requests can join."""
        if joined:
            finish(batch.admit([p.request for p in joined.values()], list(joined)))
        while batch and not (self._queue and len(batch) < self.max_batch_size):
            finish(batch.step())


class Reservation:
    """Places held in a :class:`Batcher`'s queue (see :meth:`Batcher.reserve`)."""

    def __init__(self, batcher: Batcher, count: int) -> None:
        self._batcher = batcher
        self.left = count

    def submit(self, request: GenerationRequest, *, stream: bool = False) -> asyncio.Queue[Event]:
        """Queue ``request`` in one of the held places; its events arrive on the returned queue."""
        if self.left < 1:
            raise LmforgeError("this reservation holds no place left; reserve one per request")
        self.left -= 1
        self._batcher._reserved -= 1
        return self._batcher._enqueue(request, stream)
