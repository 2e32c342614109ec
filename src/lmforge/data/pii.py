"""PII redaction: e-mail addresses, phone numbers, IPv4/IPv6 addresses and card numbers.

Each match becomes a typed placeholder (``<EMAIL>``, ``<PHONE>``, ``<IP_ADDRESS>``, ``<CARD_NUMBER>``) and
is counted per type. Card-like digit runs are redacted only when they pass the Luhn check, so order
numbers and other long digit strings survive. Patterns run in a fixed order (cards and IPs before phones)
so that one span is never claimed by two types.
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter

from lmforge.config import PiiConfig

PLACEHOLDERS = {"email": "<EMAIL>", "card": "<CARD_NUMBER>", "ip": "<IP_ADDRESS>", "phone": "<PHONE>"}

_EMAIL = re.compile(r"(?<![\w.+-])[\w.+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b")
# 13-19 digits, optionally grouped by single spaces or hyphens
_CARD = re.compile(r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])")
_IPV4 = re.compile(
    r"(?<![\d.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?![\d.])"
)
# Candidate IPv6 spans (hex groups with colons); confirmed with the ipaddress module
_IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?:%\w+)?(?![\w:])")
# International (+CC ...) or North-American style numbers with separators; 7-15 digits in all
_PHONE = re.compile(
    r"(?<![\w+])(?<!\d[ .-])(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])\d{3,4}[ .-]?\d{3,4}"
    r"(?![\w-]|[ .-]\d)"
)


def luhn_valid(digits: str) -> bool:
    """The Luhn (mod 10) checksum of a string of digits."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def _card(match: re.Match[str]) -> str | None:
    digits = re.sub(r"\D", "", match.group())
    return PLACEHOLDERS["card"] if 13 <= len(digits) <= 19 and luhn_valid(digits) else None


def _ipv6(match: re.Match[str]) -> str | None:
    span = match.group().split("%", 1)[0]
    if span.count(":") < 2 or not any(c.isdigit() or c.isalpha() for c in span):
        return None
    try:
        ipaddress.IPv6Address(span)
    except ValueError:
        return None
    return PLACEHOLDERS["ip"]


def _phone(match: re.Match[str]) -> str | None:
    digits = sum(c.isdigit() for c in match.group())
    return PLACEHOLDERS["phone"] if 7 <= digits <= 15 else None


class PiiRedactor:
    """Replace PII in text by typed placeholders; ``counts`` holds matches per type, ``docs`` docs touched."""

    def __init__(self, cfg: PiiConfig) -> None:
        self.enabled = cfg.enabled
        steps: list[tuple[str, re.Pattern[str], object]] = []
        if cfg.email:
            steps.append(("email", _EMAIL, PLACEHOLDERS["email"]))
        if cfg.card:
            steps.append(("card", _CARD, _card))
        if cfg.ip:
            steps.append(("ip", _IPV4, PLACEHOLDERS["ip"]))
            steps.append(("ip", _IPV6, _ipv6))
        if cfg.phone:
            steps.append(("phone", _PHONE, _phone))
        self._steps = steps
        self.counts: Counter[str] = Counter({kind: 0 for kind in PLACEHOLDERS})
        self.docs = 0

    def __call__(self, text: str) -> str:
        if not self.enabled:
            return text
        touched = False
        for kind, pattern, replacement in self._steps:
            # Cheap prefilters: most documents hold no '@', ':' or digit runs worth a regex pass.
            if kind == "email" and "@" not in text:
                continue
            if kind == "ip" and pattern is _IPV6 and "::" not in text and text.count(":") < 2:
                continue
            text, n = self._sub(kind, pattern, replacement, text)
            touched = touched or n > 0
        self.docs += touched
        return text

    def _sub(self, kind: str, pattern: re.Pattern[str], replacement: object, text: str) -> tuple[str, int]:
        count = 0

        def repl(match: re.Match[str]) -> str:
            nonlocal count
            out = replacement if isinstance(replacement, str) else replacement(match)  # type: ignore[operator]
            if out is None:
                return match.group()
            count += 1
            return out

        new = pattern.sub(repl, text)
        self.counts[kind] += count
        return new, count
