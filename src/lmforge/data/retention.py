"""Predicted retention: what cleaning would keep of a corpus sample under a ``clean`` config, and, when that is
little, the rule that removes most, the setting that relaxes it and the profile that would keep more.

Preflight runs it on the corpus sample it reads anyway, before any training: the per-document rules exactly
as ``clean`` runs them (normalization, language ID, Gopher, C4, FineWeb), without deduplication, which needs
the whole corpus.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import get_args

from lmforge.config import CleanConfig
from lmforge.data.cleaning import Normalize, build_rules
from lmforge.data.rules import TextView

PROFILES: tuple[str, ...] = get_args(CleanConfig.model_fields["profile"].annotation)
# Suggested in this order: the first that keeps enough relaxes the fewest rules (code turns most of them off).
_SUGGESTION_ORDER = ("web", "docs", "chat", "code")

# The first word of a rule's reason (or the rule's name) → the clean.* setting that decides it.
_SETTINGS: tuple[tuple[str, str], ...] = (
    (r"min_chars$", "clean.min_chars"),
    (r"min_words$", "clean.min_words"),
    (r"language_not_allowed$", "clean.language.allowed"),
    (r"language_low_confidence$", "clean.language.min_confidence"),
    (r"dup_(line|para)(_char)?_frac$", "clean.gopher_repetition.{0}"),
    (r"top_\d+_gram$", "clean.gopher_repetition.top_n_grams"),
    (r"duplicated_\d+_n_grams$", "clean.gopher_repetition.dup_n_grams"),
    (r"gopher_short_doc$", "clean.gopher_quality.min_doc_words"),
    (r"gopher_long_doc$", "clean.gopher_quality.max_doc_words"),
    (r"gopher_below_avg_threshold$", "clean.gopher_quality.min_avg_word_length"),
    (r"gopher_above_avg_threshold$", "clean.gopher_quality.max_avg_word_length"),
    (r"gopher_too_many_symbols$", "clean.gopher_quality.max_symbol_word_ratio"),
    (r"gopher_too_many_bullets$", "clean.gopher_quality.max_bullet_lines_ratio"),
    (r"gopher_too_many_end_ellipsis$", "clean.gopher_quality.max_ellipsis_lines_ratio"),
    (r"gopher_below_alpha_threshold$", "clean.gopher_quality.max_non_alpha_words_ratio"),
    (r"gopher_enough_stop_words$", "clean.gopher_quality.min_stop_words"),
    (r"c4_curly_bracket$", "clean.c4.filter_curly_bracket=false"),
    (r"c4_lorem_ipsum$", "clean.c4.filter_lorem_ipsum=false"),
    (r"c4_too_few_sentences$", "clean.c4.min_num_sentences"),
    (r"line_punct_ratio$", "clean.fineweb.line_punct_thr"),
    (r"short_line_ratio$", "clean.fineweb.short_line_thr"),
    (r"char_dup_ratio$", "clean.fineweb.char_duplicates_ratio"),
    (r"list_ratio$", "clean.fineweb.new_line_ratio"),
)


def setting_for(rule: str, reason: str) -> str | None:
    """The ``clean.*`` setting behind a removal (``reason``'s first word, else the rule's name)."""
    for key in (reason, rule):
        for pattern, setting in _SETTINGS:
            if match := re.match(pattern, key):
                return setting.format(match.group(0))
    return None


@dataclass
class RetentionEstimate:
    """What the rules of one config keep of a sample, and what removed the rest (``(rule, reason) → documents``)."""

    profile: str
    documents: int = 0
    kept: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    removed: Counter[tuple[str, str]] = field(default_factory=Counter)

    @property
    def fraction(self) -> float:
        """The lower of the kept shares of documents and bytes (as the gate's data_retention check takes it)."""
        if not self.documents or not self.bytes_in:
            return 1.0
        return min(self.kept / self.documents, self.bytes_out / self.bytes_in)

    def summary(self) -> str:
        """``"keeps 12 of 60 sampled documents (20%) and 14% of their bytes"``."""
        share = self.kept / max(self.documents, 1)
        return (
            f"keeps {self.kept} of {self.documents} sampled documents ({share:.0%}) and "
            f"{self.bytes_out / max(self.bytes_in, 1):.0%} of their bytes"
        )


def estimate(texts: list[str], cfg: CleanConfig) -> RetentionEstimate:
    """Run ``cfg``'s per-document rules over ``texts`` (no deduplication) and count what they keep."""
    normalize, rules = Normalize(cfg.unicode_form), build_rules(cfg)
    out = RetentionEstimate(cfg.profile, documents=len(texts))
    for text in texts:
        out.bytes_in += len(text.encode("utf-8"))
        view = TextView(normalize(text))
        rejected = next(((r.name, why) for r in rules if (why := r(view)) is not None), None)
        if rejected is None:
            out.kept += 1
            out.bytes_out += len(view.text.encode("utf-8"))
        else:
            out.removed[(rejected[0], rejected[1].split(" ", 1)[0])] += 1
    return out


def _with_profile(cfg: CleanConfig, profile: str) -> CleanConfig:
    """``cfg``'s reading and language settings under another profile's thresholds."""
    keep = {"text_field": cfg.text_field, "unicode_form": cfg.unicode_form, "pii": cfg.pii.model_dump()}
    return CleanConfig.model_validate({**keep, "profile": profile})


def advice(texts: list[str], cfg: CleanConfig, warning: float) -> tuple[RetentionEstimate, str | None]:
    """The estimate under ``cfg`` and, when it keeps less than ``warning``, a message naming the rule that removes
    most, the setting behind it and a profile that keeps more: the first of web, docs, chat, code that reaches
    ``warning``, else the one that keeps the most."""
    own = estimate(texts, cfg)
    if own.fraction >= warning or not own.removed:
        return own, None
    (rule, reason), count = own.removed.most_common(1)[0]
    message = (
        f"cleaning with clean.profile={cfg.profile} {own.summary()}, below the {warning:.0%} warning level; "
        f"the rule removing most is {rule} ({reason}: {count} documents)"
    )
    if setting := setting_for(rule, reason):
        message += f", set by {setting}"
    others = [estimate(texts, _with_profile(cfg, p)) for p in _SUGGESTION_ORDER if p != cfg.profile]
    best = next((e for e in others if e.fraction >= warning), max(others, key=lambda e: e.fraction))
    if best.fraction > own.fraction:
        message += f"; clean.profile={best.profile} {best.summary()}"
    removed = ", ".join(f"{r} {why} {n}" for (r, why), n in own.removed.most_common(5))
    return own, f"{message} (removed in the sample: {removed})"
