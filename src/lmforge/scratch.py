"""Scratch directories that do not outlive their process, even a killed one.

:func:`scratch_dir` holds its directory locked (``flock`` on the directory itself) while in use and removes it on
exit. A process killed by SIGKILL, the OOM killer or a node drain cannot clean up, but its lock goes with it: the
next :func:`scratch_dir` with the same prefix in the same parent first removes every directory of that prefix
that nobody holds (:func:`remove_stale`). A directory still locked belongs to a live process and is left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from lmforge.storage import write_error

log = logging.getLogger("lmforge.scratch")

# A fresh directory is made under this prefix, locked, then renamed to its real prefix, so a sweep never sees
# one of ours before it is locked. One killed in between stays behind empty under this name.
_CLAIMING = ".lmforge-claiming-"


def remove_stale(parent: str | os.PathLike[str], prefix: str) -> list[Path]:
    """Remove the directories ``parent/prefix*`` that no live process holds; returns what was removed."""
    parent = Path(parent)
    removed: list[Path] = []
    try:
        entries = [e for e in parent.iterdir() if e.name.startswith(prefix)]
    except FileNotFoundError:
        return removed
    for entry in entries:
        if entry.is_symlink() or not entry.is_dir():
            continue
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue  # removed meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its process is alive
        else:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            log.info("removed %s, left behind by a process that was killed", entry)
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def scratch_dir(prefix: str, parent: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """A new directory ``parent/prefix<random>`` (default parent: the temp dir), removed on exit.

    Stale directories of the same prefix left by killed processes are removed first. The directory may be
    renamed away by the caller (as :func:`lmforge.artifacts.staged_output` does); what is left at its name on
    exit is removed.
    """
    parent = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    try:
        parent.mkdir(parents=True, exist_ok=True)
        remove_stale(parent, prefix)
        fresh = Path(tempfile.mkdtemp(prefix=_CLAIMING, dir=parent))
    except OSError as exc:
        raise write_error(parent, exc) from exc
    fd = os.open(fresh, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        path = parent / f"{prefix}{fresh.name[len(_CLAIMING) :]}"
        os.rename(fresh, path)
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(fd)
        if fresh.exists():
            shutil.rmtree(fresh, ignore_errors=True)
