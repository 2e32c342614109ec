"""A test server as a child process: started in a session of its own (so that stopping it can signal the whole
process group) with its output appended to a log file, then polled until it answers."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def start_logged(cmd: list[str], log: Path, **popen: Any) -> subprocess.Popen:
    """Start ``cmd`` in a new session, its stdout and stderr appended to ``log``."""
    out = open(log, "ab")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **popen)


def wait_until_ready(
    process: subprocess.Popen,
    ready: Callable[[], bool],
    *,
    timeout: float,
    log: Path,
    program: str,
    service: str,
    stop: Callable[[], None],
) -> None:
    """Poll ``ready`` every 0.5 s until it is true; raise if ``process`` exits first, or ``stop`` and raise after
    ``timeout`` seconds. The errors name ``program`` (what exited) or ``service`` (what did not answer) and ``log``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{program} exited with {process.returncode}; see {log}")
        if ready():
            return
        time.sleep(0.5)
    stop()
    raise RuntimeError(f"{service} not ready after {timeout:.0f} s; see {log}")
