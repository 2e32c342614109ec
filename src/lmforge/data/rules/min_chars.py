"""Drop documents shorter than a number of characters: a cheap floor ahead of the statistical rules."""

from __future__ import annotations

from lmforge.data.rules.base import Rule
from lmforge.data.rules.text_view import TextView


class MinChars(Rule):
    """Drop documents shorter than ``min_chars`` characters."""

    name = "min_chars"

    def __init__(self, min_chars: int) -> None:
        super().__init__()
        self.min_chars = min_chars

    def check(self, view: TextView) -> str | None:
        n = len(view.text)
        return None if n >= self.min_chars else f"{n} chars < {self.min_chars}"
