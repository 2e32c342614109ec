"""Text as a reader sees it, with every character traced back to where it came from in the original.

A secret can reach a file escaped or broken up: ``report.html`` escapes ``&`` and puts a ``<wbr>`` after each path
separator (``aws/<wbr>secret``), ``json.dumps`` writes ``\\/`` or ``\\u002f``, a URL carries ``%2F``, and a
soft hyphen or zero-width space renders as nothing. :func:`views` decodes those layer by layer (HTML character
references, ``%XX`` runs as UTF-8, JSON/YAML backslash escapes; ``<wbr>`` and invisible characters dropped) so
that a plain search finds the secret in one of the views, and :meth:`View.source_span` says which characters of
the original text to replace.
"""

from __future__ import annotations

import bisect
import html
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

# Characters that render as nothing: soft hyphen, zero-width space / non-joiner / joiner, word joiner, BOM.
INVISIBLE = frozenset("\u00ad\u200b\u200c\u200d\u2060\ufeff")
_ESCAPE = re.compile(
    r"&(?:#[0-9]{1,7}|#[xX][0-9a-fA-F]{1,6}|[A-Za-z][A-Za-z0-9]{1,31});?"  # HTML character reference
    r"|(?:%[0-9A-Fa-f]{2})+"  # URL-encoded bytes
    r"|\\u[0-9A-Fa-f]{4}|\\x[0-9A-Fa-f]{2}|\\[\\/\"'bfnrt]"  # JSON / YAML / Python string escapes
    r"|<[Ww][Bb][Rr]\s*/?>"  # HTML line-break opportunity
    r"|[\u00ad\u200b\u200c\u200d\u2060\ufeff]"
)
_BACKSLASH = {"\\": "\\", "/": "/", '"': '"', "'": "'", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
MAX_LAYERS = 3  # decoding rounds: enough for HTML-escaped JSON of a URL-encoded value (&amp;, \\u0026, %25)


@dataclass
class View:
    """One decoding of a source text: ``text``, and for each run of it the source characters it came from.

    ``runs`` holds ``(view_start, view_length, source_start, source_end, literal)``, sorted by ``view_start``;
    a literal run maps character by character, a decoded one (``&amp;``) maps each of its characters to the
    whole escape.
    """

    text: str
    runs: list[tuple[int, int, int, int, bool]] = field(default_factory=list)
    _starts: list[int] = field(default_factory=list)

    def source_span(self, start: int, end: int) -> tuple[int, int]:
        """The span of the source text that the view's ``text[start:end]`` (``end > start``) came from."""
        return self._source(start)[0], self._source(end - 1)[1]

    def _source(self, index: int) -> tuple[int, int]:
        if not self._starts:
            self._starts = [run[0] for run in self.runs]
        view_start, _, source_start, source_end, literal = self.runs[bisect.bisect_right(self._starts, index) - 1]
        if literal:
            at = source_start + index - view_start
            return at, at + 1
        return source_start, source_end


def decode(text: str) -> View | None:
    """``text`` with one layer of escapes decoded and invisible breaks dropped; ``None`` when it has none."""
    parts: list[str] = []
    view = View("")
    length = last = 0

    def add(chars: str, start: int, end: int, literal: bool) -> None:
        nonlocal length
        if chars:
            parts.append(chars)
            view.runs.append((length, len(chars), start, end, literal))
            length += len(chars)

    found = False
    for match in _ESCAPE.finditer(text):
        found = True
        add(text[last : match.start()], last, match.start(), True)
        for chars, start, end in _decoded(match):
            add(chars, start, end, chars == text[start:end])
        last = match.end()
    if not found:
        return None
    add(text[last:], last, len(text), True)
    view.text = "".join(parts)
    return view


def views(text: str) -> Iterator[tuple[str, list[View]]]:
    """``text`` itself, then each decoded layer of it (at most :data:`MAX_LAYERS`), with the views leading there.

    Map a span of a layer back to ``text`` with :func:`source_span` and the views yielded with it.
    """
    chain: list[View] = []
    yield text, chain
    for _ in range(MAX_LAYERS):
        view = decode(text)
        if view is None or view.text == text:
            return
        chain = [*chain, view]
        text = view.text
        yield text, chain


def source_span(chain: list[View], start: int, end: int) -> tuple[int, int]:
    """The span of the original text behind ``[start, end)`` of the last view of ``chain``."""
    for view in reversed(chain):
        start, end = view.source_span(start, end)
    return start, end


def _decoded(match: re.Match[str]) -> Iterator[tuple[str, int, int]]:
    """The characters one escape stands for, each with its source span (a ``%XX`` run: one per character)."""
    token, at = match[0], match.start()
    if token.startswith("%"):
        data = bytes.fromhex(token.replace("%", ""))
        i = 0
        while i < len(data):
            size = _utf8_size(data[i])
            try:
                char = data[i : i + size].decode("utf-8")
            except UnicodeDecodeError:
                char, size = token[3 * i : 3 * i + 3], 1  # not UTF-8: keep the escape as it is
            yield _visible(char), at + 3 * i, at + 3 * (i + size)
            i += size
        return
    if token.startswith("&"):
        char = html.unescape(token)
    elif token[:2] in ("\\u", "\\x"):
        char = chr(int(token[2:], 16))
    elif token.startswith("\\"):
        char = _BACKSLASH[token[1]]
    else:  # <wbr> or an invisible character
        char = ""
    yield _visible(char), at, match.end()


def _visible(chars: str) -> str:
    return "".join(c for c in chars if c not in INVISIBLE)


def _utf8_size(lead: int) -> int:
    return 1 if lead < 0xC0 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
