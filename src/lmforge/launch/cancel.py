"""Turn SIGTERM (a pod stopped because its run was cancelled) into an exception, so waiting code can clean up."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class CancelRequested(BaseException):
    """Raised from the SIGTERM handler inside the wait; BaseException so nothing in between swallows it."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While waiting, turn SIGTERM (pod stop on run cancel) into an exception so the job gets deleted."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread; callers there rely on KeyboardInterrupt
        return

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt the cleanup
        raise CancelRequested(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
