"""Drop documents with too few words (:attr:`TextView.words`: whitespace-separated, Han characters one each)."""

from __future__ import annotations

from lmforge.data.rules.base import Rule
from lmforge.data.rules.text_view import TextView


class MinWords(Rule):
    """Drop documents with fewer than ``min_words`` whitespace-separated words."""

    name = "min_words"

    def __init__(self, min_words: int) -> None:
        super().__init__()
        self.min_words = min_words

    def check(self, view: TextView) -> str | None:
        n = len(view.words)
        return None if n >= self.min_words else f"{n} words < {self.min_words}"
