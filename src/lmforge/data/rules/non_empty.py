"""Drop documents that normalization left empty (the first rule, so the others never see an empty text)."""

from __future__ import annotations

from lmforge.data.rules.base import Rule
from lmforge.data.rules.text_view import TextView


class NonEmpty(Rule):
    """Drop documents that are empty after normalization."""

    name = "empty"

    def check(self, view: TextView) -> str | None:
        return None if view.text else "empty after normalization"
