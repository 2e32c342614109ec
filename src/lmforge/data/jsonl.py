"""JSON Lines read with bounded memory, where no line can crash the reader.

:func:`iter_json_lines` yields each non-blank line's JSON value, or a :class:`BadLine` naming what is wrong with
it: longer than the limit (the rest of the line is read and dropped in chunks, never held), not UTF-8, not JSON,
nested too deeply for the parser (``RecursionError``) or any other ``ValueError`` of the decoder. A UTF-8 byte
order mark before the first line is accepted (``utf-8-sig``). What a bad line costs is the caller's decision:
the corpus reader counts it, the Q&A reader stops with ``file:line``.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

DEFAULT_MAX_RECORD_BYTES = 16 * 1024 * 1024
_SKIP_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class BadLine:
    """A line that holds no usable JSON value, and why."""

    problem: str


def read_line(fh: IO[bytes], max_bytes: int) -> bytes | None:
    """The next line of ``fh`` (newline kept; ``b""`` at the end), or ``None`` when it is longer than ``max_bytes``.

    A line that is too long is consumed up to and including its newline, ``_SKIP_CHUNK`` bytes at a time.
    """
    raw = fh.readline(max_bytes + 1)
    if len(raw) <= max_bytes or raw.endswith(b"\n"):
        return raw
    while chunk := fh.readline(_SKIP_CHUNK):
        if chunk.endswith(b"\n"):
            break
    return None


def parse_json_line(raw: bytes, *, first: bool = False) -> Any:
    """The JSON value on one line, or a :class:`BadLine`; ``first`` accepts a leading UTF-8 byte order mark."""
    if first and raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8) :]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return BadLine(f"invalid UTF-8 at byte {exc.start}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        return BadLine(f"not valid JSON ({exc.msg} at char {exc.pos})")
    except RecursionError:
        return BadLine("not valid JSON (nested too deeply)")
    except ValueError as exc:  # e.g. an integer literal longer than Python's int_max_str_digits
        return BadLine(f"not valid JSON ({exc})")


def iter_json_lines(
    fh: IO[bytes],
    *,
    max_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    wanted: Callable[[int], bool] | None = None,
    stream_errors: tuple[type[BaseException], ...] = (),
) -> Iterator[tuple[int, Any]]:
    """``(line number, value or BadLine)`` for each non-blank line of a binary stream, numbered from 1.

    Args:
        max_bytes: Longest line accepted, newline excluded; a longer one is a :class:`BadLine`.
        wanted: Only lines for which this is true are decoded and yielded (the others are still read).
        stream_errors: Exceptions of the stream itself (a corrupt or truncated compressed file): one is reported
            as a :class:`BadLine` on the line where it happened, and ends the iteration.
    """
    lineno = 0
    while True:
        try:
            raw = read_line(fh, max_bytes)
        except stream_errors as exc:
            if wanted is None or wanted(lineno + 1):
                yield lineno + 1, BadLine(f"cannot decompress, rest of file skipped ({exc})")
            return
        if raw == b"":
            return
        lineno += 1
        if wanted is not None and not wanted(lineno):
            continue
        if raw is None:
            yield lineno, BadLine(f"line longer than {max_bytes} bytes")
            continue
        if not raw.strip() or (lineno == 1 and raw.strip() == codecs.BOM_UTF8):
            continue
        yield lineno, parse_json_line(raw, first=lineno == 1)
