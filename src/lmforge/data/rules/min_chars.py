"""Drop documents shorter than a number of characters: a cheap floor ahead of the statistical rules."""

from __future__ import annotations

from lmforge.data.rules.base import MinCount
from lmforge.data.rules.text_view import TextView


class MinChars(MinCount):
    """Drop documents shorter than ``minimum`` characters."""

    name = "min_chars"
    unit = "chars"

    def count(self, view: TextView) -> int:
        return len(view.text)
