"""Keep credentials out of what is sent to MLflow: secret-looking keys, secret env values, URL passwords.

Three rules, applied to every param, tag and uploaded text file:

* a key (or any dotted part of it) whose words name a credential (the words of
  :data:`lmforge.config.base.CREDENTIAL_WORDS`, matched as whole words so that ``max_new_tokens`` is not one;
  the last word also in the plural, ``credentials``, but not ``tokens``, a count) has its
  value replaced by ``***``; tokenizer special tokens (``eos_token``) are not credentials;
* the value of every environment variable whose name looks like a credential (``AWS_SECRET_ACCESS_KEY``,
  ``MLFLOW_TRACKING_TOKEN``, ...) and of every secret-looking config key is replaced wherever it appears;
* the password of a URL (``https://user:password@host``) is replaced.

The values are found however the text escapes or breaks them up (HTML character references and ``<wbr>``, soft
hyphens and zero-width characters, ``%XX``, JSON backslash escapes; :mod:`lmforge.tracking.unescape`): the
escaped characters that spell a secret are replaced, the rest of the text is kept as it is.

Nothing here logs or returns the environment.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from lmforge.config.base import CREDENTIAL_WORDS, URL_PASSWORD
from lmforge.tracking.unescape import source_span, views

REDACTED = "***"
_SECRET_WORDS = tuple(w.split("_") for w in CREDENTIAL_WORDS)
_SPECIAL_TOKEN = re.compile(r"^(bos|eos|pad|unk|sep|cls|mask)_token$", re.IGNORECASE)
_MIN_SECRET_CHARS = 6  # shorter env values ("1", "true") would redact ordinary text


def secret_like(key: str) -> bool:
    """True when a (dotted) key or env var name names a credential, by whole words of any of its parts."""
    for part in key.split("."):
        if _SPECIAL_TOKEN.match(part):
            continue
        split_camel = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", part)  # secretKey -> secret_Key
        words = [w for w in re.split(r"[^A-Za-z0-9]+", split_camel.upper()) if w]
        for secret in _SECRET_WORDS:
            n = len(secret)
            if any(_same(words[i : i + n], secret) for i in range(len(words) - n + 1)):
                return True
    return False


def _same(words: list[str], secret: list[str]) -> bool:
    """Words equal, the last one also in the plural (``credentials``), except ``tokens``: a count, not a secret."""
    *head, last = secret
    plural = [*head, f"{last}S"] if last != "TOKEN" else None
    return words in (secret, plural)


def redact_url(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@`` replaced."""
    return URL_PASSWORD.sub(lambda m: f"{m['head']}:{REDACTED}@", text)


class Scrubber:
    """Replaces known secret values, URL passwords and secret-keyed values in what goes to MLflow."""

    def __init__(self, secrets: Iterable[str] = (), *, env: Mapping[str, str] | None = None) -> None:
        environ = os.environ if env is None else env
        values = {v for k, v in environ.items() if secret_like(k)} | set(secrets)
        # Overlapping finds (a secret inside another) merge into one ``***``; longest first only for tidiness.
        self._values = sorted((v for v in values if len(v) >= _MIN_SECRET_CHARS), key=len, reverse=True)

    def add(self, values: Iterable[str]) -> None:
        """Also replace these values from now on (secret-keyed config values found while flattening)."""
        more = {v for v in values if len(v) >= _MIN_SECRET_CHARS} - set(self._values)
        self._values = sorted([*self._values, *more], key=len, reverse=True)

    def text(self, value: str) -> str:
        """``value`` with every known secret and URL password replaced by ``***``, escaped forms included."""
        spans = []
        for layer, chain in views(value):
            for start, end in self._found(layer):
                spans.append(source_span(chain, start, end))
        out, last = [], 0
        for start, end in sorted(spans):
            if end <= last:
                continue
            if start >= last:
                out += [value[last:start], REDACTED]
            last = end
        return "".join([*out, value[last:]])

    def _found(self, text: str) -> list[tuple[int, int]]:
        """Spans of every known secret and URL password in ``text``."""
        spans = [m.span("password") for m in URL_PASSWORD.finditer(text)]
        for secret in self._values:
            at = text.find(secret)
            while at >= 0:
                spans.append((at, at + len(secret)))
                at = text.find(secret, at + len(secret))
        return spans

    def mapping(self, items: Mapping[str, Any], *, limit: int) -> dict[str, str]:
        """String values for MLflow: secret-keyed values redacted, the rest scrubbed and cut to ``limit`` chars."""
        secret_values = [str(v) for k, v in items.items() if secret_like(k) and v not in (None, "")]
        self.add(secret_values)
        out = {}
        for key, value in items.items():
            text = REDACTED if secret_like(key) and value not in (None, "") else self.text(as_text(value))
            out[key] = truncate(text, limit)
        return out


def as_text(value: Any) -> str:
    """A param/tag value as text: strings as is, everything else as JSON (``null``, ``true``, ``[1, 2]``)."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def truncate(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` chars, saying how much was cut."""
    if len(text) <= limit:
        return text
    marker = f"...[{len(text)} chars]"
    return text[: limit - len(marker)] + marker


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys (``train.optimizer.lr``); lists and scalars stay values."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat
