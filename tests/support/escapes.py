"""Whether a secret can still be read out of a text, by the standard library's decoders (not lmforge's)."""

from __future__ import annotations

import html
import json
import re
import urllib.parse

_WBR = re.compile(r"(?i)<wbr\s*/?>")
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_INVISIBLE = re.compile("[\u00ad\u200b\u200c\u200d\u2060\ufeff]")


def spelled_out(text: str, secret: str) -> bool:
    """True when ``secret`` is in ``text`` as a browser, a JSON parser or a URL decoder reads it, or two of them.

    Readings: the text; HTML-unescaped with ``<wbr>`` dropped; the JSON string literals in either, decoded; each of
    those URL-decoded, then HTML-unescaped again; soft hyphens and zero-width characters dropped from all.
    """
    readings = [text, html.unescape(_WBR.sub("", text))]
    readings += [" ".join(_json(s) for s in _JSON_STRING.findall(r)) for r in list(readings)]
    readings += [urllib.parse.unquote(r) for r in list(readings)]
    readings += [html.unescape(_WBR.sub("", r)) for r in list(readings)]
    return any(secret in _INVISIBLE.sub("", r) for r in readings)


def _json(literal: str) -> str:
    try:
        return json.loads(literal)
    except json.JSONDecodeError:
        return literal
