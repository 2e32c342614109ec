"""The rule contract every cleaning rule follows, and the constants and statistics several rules share.

A rule's :meth:`Rule.check` returns ``None`` to keep a document or a reason string (the rules with several
tests start it with the failed test's name, e.g. ``dup_line_frac 0.50 > 0.3``); :meth:`Rule.__call__` counts
the rejection in ``removed`` and under the reason's first word in ``reasons`` (datatrove's ``dropped_{reason}``
stats), which the ``clean`` stage reports.
"""

from __future__ import annotations

from collections import Counter
from typing import ClassVar, Generic, Protocol, TypeVar

from lmforge.data.rules.text_view import UNDETERMINED_LANG, TextView

TERMINAL_PUNCTUATION = (".", "!", "?", '"', "'", "…", "。", "！", "？", "”", "’")


def duplicate_share(items: list[str]) -> tuple[int, int]:
    """``(items that repeat an earlier one, characters in those repeats)``."""
    seen: set[str] = set()
    dup_items = dup_chars = 0
    for item in items:
        if item in seen:
            dup_items += 1
            dup_chars += len(item)
        else:
            seen.add(item)
    return dup_items, dup_chars


class Rule:
    """One cleaning rule: :meth:`check` returns ``None`` to keep a document, else the reason."""

    name: ClassVar[str]

    def __init__(self, languages: list[str] | None = None) -> None:
        self.removed = 0
        self.reasons: Counter[str] = Counter()
        self.languages = frozenset(languages) if languages is not None else None

    def applies(self, view: TextView) -> bool:
        """Whether the rule is tuned for the document's language (undetermined counts as applicable)."""
        return self.languages is None or view.lang == UNDETERMINED_LANG or view.lang in self.languages

    def check(self, view: TextView) -> str | None:
        """The reason to drop the document, or ``None`` to keep it."""
        raise NotImplementedError

    def __call__(self, view: TextView | str) -> str | None:
        """:meth:`check` the document (a string is wrapped in a view) if the rule applies; count a rejection."""
        if isinstance(view, str):
            view = TextView(view)
        if not self.applies(view):
            return None
        reason = self.check(view)
        if reason is not None:
            self.removed += 1
            self.reasons[reason.split(" ", 1)[0]] += 1
        return reason


class _RuleConfig(Protocol):
    languages: list[str]


ConfigT = TypeVar("ConfigT", bound=_RuleConfig)


class ConfiguredRule(Rule, Generic[ConfigT]):
    """A rule with its own config section (thresholds in ``cfg``), applied to the section's ``languages``."""

    def __init__(self, cfg: ConfigT) -> None:
        super().__init__(cfg.languages)
        self.cfg = cfg


class MinCount(Rule):
    """Drop documents with fewer than ``minimum`` of what :meth:`count` counts (``unit`` in the reason)."""

    unit: ClassVar[str]

    def __init__(self, minimum: int) -> None:
        super().__init__()
        self.minimum = minimum

    def count(self, view: TextView) -> int:
        """How many the document has."""
        raise NotImplementedError

    def check(self, view: TextView) -> str | None:
        n = self.count(view)
        return None if n >= self.minimum else f"{n} {self.unit} < {self.minimum}"
