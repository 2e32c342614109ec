"""Gopher's quality rules (Rae et al. 2021, "Scaling Language Models"; datatrove's
``GopherQualityFilter``): drop documents whose word count, mean word length, symbol/word ratio, bullet
or ellipsis lines, share of alphabetic words or stop-word count fall outside the published bounds.
"""

from __future__ import annotations

import re

from lmforge.config import GopherQualityConfig
from lmforge.data.rules.base import Rule
from lmforge.data.rules.text_view import TextView

BULLETS = ("•", "●", "○", "▪", "‣", "◦", "-", "*")
# A whitespace-separated word without a letter or numeral: ``[^\W\d_]`` (word characters but digits and
# ``_``) is ``str.isalpha`` plus the numerals outside ``\d`` (Unicode Nl/No: Ⅻ, ½, ²...).
_LETTERLESS_WORD = re.compile(r"(?<!\S)(?:[\d_]|[^\w\s])++(?!\S)")


def _is_numeral(c: str) -> bool:
    """A character ``[^\\W\\d_]`` matches that is not alphabetic."""
    return c.isnumeric() and not c.isdecimal() and not c.isalpha()


def alphabetic_words(view: TextView) -> int:
    """How many of ``view.words`` hold at least one alphabetic (``str.isalpha``) character."""
    text = view.text
    if view.split_han or (not text.isascii() and any(map(_is_numeral, set(text)))):
        return sum(any(c.isalpha() for c in w) for w in view.words)
    # Without numerals, the words that hold no letter are the regex's matches (few, so few objects built).
    return len(view.words) - len(_LETTERLESS_WORD.findall(text))


class GopherQuality(Rule):
    """Gopher quality: word count and length, symbols, bullets, ellipses, alphabetic words, stop words."""

    name = "gopher_quality"

    def __init__(self, cfg: GopherQualityConfig) -> None:
        super().__init__(cfg.languages)
        self.cfg = cfg
        self.stop_words = frozenset(cfg.stop_words)

    def check(self, view: TextView) -> str | None:
        cfg = self.cfg
        words = view.bare_words
        n = len(words)
        if cfg.min_doc_words is not None and n < cfg.min_doc_words:
            return f"gopher_short_doc {n} words < {cfg.min_doc_words}"
        if cfg.max_doc_words is not None and n > cfg.max_doc_words:
            return f"gopher_long_doc {n} words > {cfg.max_doc_words}"
        if n == 0:
            return "gopher_short_doc no words"
        mean = float(view.bare_word_lengths.mean())
        if cfg.min_avg_word_length is not None and mean < cfg.min_avg_word_length:
            return f"gopher_below_avg_threshold mean word length {mean:.2f} < {cfg.min_avg_word_length}"
        if cfg.max_avg_word_length is not None and mean > cfg.max_avg_word_length:
            return f"gopher_above_avg_threshold mean word length {mean:.2f} > {cfg.max_avg_word_length}"
        text = view.text
        if cfg.max_symbol_word_ratio is not None:
            symbols = text.count("#") + text.count("...") + text.count("…")
            if symbols / n > cfg.max_symbol_word_ratio:
                return f"gopher_too_many_symbols {symbols / n:.3f} per word > {cfg.max_symbol_word_ratio}"
        lines = view.nonempty_lines or [""]
        if cfg.max_bullet_lines_ratio is not None:
            ratio = sum(line.lstrip().startswith(BULLETS) for line in lines) / len(lines)
            if ratio > cfg.max_bullet_lines_ratio:
                return f"gopher_too_many_bullets {ratio:.2f} of lines > {cfg.max_bullet_lines_ratio}"
        if cfg.max_ellipsis_lines_ratio is not None:
            ratio = sum(line.rstrip().endswith(("...", "…")) for line in lines) / len(lines)
            if ratio > cfg.max_ellipsis_lines_ratio:
                return f"gopher_too_many_end_ellipsis {ratio:.2f} of lines > {cfg.max_ellipsis_lines_ratio}"
        if cfg.max_non_alpha_words_ratio is not None:
            alpha = alphabetic_words(view) / max(len(view.words), 1)
            if alpha < cfg.max_non_alpha_words_ratio:
                return f"gopher_below_alpha_threshold {alpha:.2f} of words alphabetic < {cfg.max_non_alpha_words_ratio}"
        if cfg.min_stop_words is not None:
            # Stop words are common: counting stops once the threshold is reached (the count only
            # appears in the reason when it falls short, and then it is complete).
            stops = 0
            for w in words:
                if w in self.stop_words:
                    stops += 1
                    if stops >= cfg.min_stop_words:
                        break
            if stops < cfg.min_stop_words:
                return f"gopher_enough_stop_words {stops} stop words < {cfg.min_stop_words}"
        return None
