"""Exit codes of lmforge processes (CLI commands and KFP components), and the one-line error of an input mistake.

An error the user can fix in the inputs or the config (bad data, a bad field, a release version that already
exists) fails the same way on every attempt: the process prints one ``error: ...`` line, no traceback, and exits
with :data:`EXIT_INPUT_ERROR`. Anything else (a bug, a storage or cluster failure, a preempted node) keeps its
traceback and exits with :data:`EXIT_FAILURE`.

The exit code does not stop a retry: Argo retries every failed attempt of a task with a KFP retry policy, and
the KFP launcher exits 1 whatever the component's code; ``kfp.local`` retries any non-zero code
(``docs/retries.md``). It tells a person or a wrapper (``lmforge run``, CI) which kind of failure it was.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from lmforge.errors import ConfigError, InputDataError, ReleaseExistsError

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_INPUT_ERROR = 2
INPUT_ERRORS: tuple[type[Exception], ...] = (ConfigError, InputDataError, ReleaseExistsError)
"""Errors that rerunning the same inputs and config repeats: each fixed by changing them, never by a retry."""

log = logging.getLogger("lmforge")


def is_input_error(exc: BaseException) -> bool:
    """True for an error in the inputs or the config (see :data:`INPUT_ERRORS`)."""
    return isinstance(exc, INPUT_ERRORS)


def exit_code(exc: BaseException) -> int:
    """:data:`EXIT_INPUT_ERROR` for an input or config error, :data:`EXIT_FAILURE` for anything else."""
    return EXIT_INPUT_ERROR if is_input_error(exc) else EXIT_FAILURE


def error_line(exc: BaseException) -> str:
    """``error: <message>`` on one line (a message's line breaks become spaces)."""
    return "error: " + " ".join(str(exc).split("\n")).strip()


@contextmanager
def exit_on_input_error() -> Iterator[None]:
    """Turn an input or config error raised inside into its :func:`error_line` and ``SystemExit(2)``.

    The line is logged at ERROR on the ``lmforge`` logger, so it is the last line of the task's log. Other
    exceptions pass through unchanged (with their traceback, exit code 1).
    """
    try:
        yield
    except INPUT_ERRORS as exc:
        log.error("%s", error_line(exc))
        raise SystemExit(EXIT_INPUT_ERROR) from None
