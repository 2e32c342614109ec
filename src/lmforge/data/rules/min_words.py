"""Drop documents with too few words (:attr:`TextView.words`: whitespace-separated, Han characters one each)."""

from __future__ import annotations

from lmforge.data.rules.base import MinCount
from lmforge.data.rules.text_view import TextView


class MinWords(MinCount):
    """Drop documents with fewer than ``minimum`` whitespace-separated words."""

    name = "min_words"
    unit = "words"

    def count(self, view: TextView) -> int:
        return len(view.words)
