"""C4's cleaning rules (Raffel et al. 2020, "Exploring the Limits of Transfer Learning";
datatrove's ``C4QualityFilter``): drop boilerplate lines (too few words, no terminal punctuation,
javascript notices, policy notices, giant words; citation marks removed), then whole documents that
hold lorem ipsum or a curly bracket (code) or keep too few sentences. The only rule that rewrites text.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

from lmforge.config import C4Config
from lmforge.data.rules.base import TERMINAL_PUNCTUATION, ConfiguredRule
from lmforge.data.rules.text_view import TextView

_SENTENCE_END = re.compile(r"[.!?。！？]+[\"'”’)\]]*(?:\s|$)")
_CITATION = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]", re.IGNORECASE)
_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")


def _at_least(items: Iterator[object], n: int) -> bool:
    """Whether ``items`` yields at least ``n`` items (consuming no more than ``n``)."""
    return sum(1 for _ in itertools.islice(items, n)) == n


class C4Lines(ConfiguredRule[C4Config]):
    """C4: drop boilerplate lines (short, javascript, policy, giant words), then documents that are code,
    lorem ipsum or have too few sentences left. Rewrites ``view`` in place when it drops lines."""

    name = "c4"

    def __init__(self, cfg: C4Config) -> None:
        super().__init__(cfg)
        self.lines_removed = 0

    def check(self, view: TextView) -> str | None:
        cfg = self.cfg
        lower = view.text.lower()
        if cfg.filter_lorem_ipsum and "lorem ipsum" in lower:
            return "c4_lorem_ipsum"
        if cfg.filter_curly_bracket and "{" in view.text:
            return "c4_curly_bracket"
        # Citation marks hold no newline, so removing them from the whole text removes them from every
        # line: the phrase tests below only look at lines when the whole text contains the phrase.
        cite = cfg.remove_citations and "[" in view.text
        searched = _CITATION.sub("", view.text).lower() if cite else lower
        javascript = cfg.filter_javascript and "javascript" in searched
        policy = cfg.filter_policy and any(p in searched for p in _POLICY)
        kept: list[str] = []
        dropped = 0
        for line in view.lines:
            if not line.strip():
                kept.append(line)
                continue
            if cite and "[" in line:
                line = _CITATION.sub("", line)
            words = line.split()
            if (
                (cfg.min_words_per_line and len(words) < cfg.min_words_per_line)
                or (cfg.filter_no_terminal_punct and not line.rstrip().endswith(TERMINAL_PUNCTUATION))
                or (cfg.filter_no_terminal_punct and line.rstrip().endswith(("...", "…")))
                or (len(line) > cfg.max_word_length and any(len(w) > cfg.max_word_length for w in words))
                or (javascript and "javascript" in line.lower())
                or (policy and any(p in line.lower() for p in _POLICY))
            ):
                dropped += 1
                continue
            kept.append(line)
        text = "\n".join(kept).strip()
        if cfg.min_num_sentences and not _at_least(_SENTENCE_END.finditer(text), cfg.min_num_sentences):
            return f"c4_too_few_sentences fewer than {cfg.min_num_sentences} sentences"
        if text != view.text:
            self.lines_removed += dropped
            view.replace_text(text)
        return None
