"""Gopher's quality rules (Rae et al. 2021, "Scaling Language Models"; datatrove's
``GopherQualityFilter``): drop documents whose word count, mean word length, symbol/word ratio, bullet
or ellipsis lines, share of alphabetic words or stop-word count fall outside the published bounds.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from lmforge.config import GopherQualityConfig
from lmforge.data.rules.base import ConfiguredRule
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


def _share_of_lines(view: TextView, matches: Callable[[str], bool]) -> float:
    """The share of the non-empty lines that ``matches`` (a text without one counts as one empty line)."""
    lines = view.nonempty_lines or [""]
    return sum(matches(line) for line in lines) / len(lines)


def _bulleted(line: str) -> bool:
    return line.lstrip().startswith(BULLETS)


def _trailing_ellipsis(line: str) -> bool:
    return line.rstrip().endswith(("...", "…"))


def _too_many_lines(view: TextView, matches: Callable[[str], bool], limit: float | None, reason: str) -> str | None:
    """``reason`` with the share when more than ``limit`` of the lines match (:func:`_share_of_lines`), else
    ``None`` (and always with no limit)."""
    if limit is None:
        return None
    ratio = _share_of_lines(view, matches)
    return f"{reason} {ratio:.2f} of lines > {limit}" if ratio > limit else None


class GopherQuality(ConfiguredRule[GopherQualityConfig]):
    """Gopher quality: word count and length, symbols, bullets, ellipses, alphabetic words, stop words."""

    name = "gopher_quality"

    def __init__(self, cfg: GopherQualityConfig) -> None:
        super().__init__(cfg)
        self.stop_words = frozenset(cfg.stop_words)

    def check(self, view: TextView) -> str | None:
        for test in (
            self._word_count,
            self._word_length,
            self._symbols,
            self._bullets,
            self._ellipses,
            self._alphabetic,
            self._stop_words,
        ):
            if (reason := test(view)) is not None:
                return reason
        return None

    def _word_count(self, view: TextView) -> str | None:
        """Too few or too many words, or none (the tests after this one divide by the count)."""
        cfg, n = self.cfg, len(view.bare_words)
        if cfg.min_doc_words is not None and n < cfg.min_doc_words:
            return f"gopher_short_doc {n} words < {cfg.min_doc_words}"
        if cfg.max_doc_words is not None and n > cfg.max_doc_words:
            return f"gopher_long_doc {n} words > {cfg.max_doc_words}"
        return "gopher_short_doc no words" if n == 0 else None

    def _word_length(self, view: TextView) -> str | None:
        """A mean word length outside ``[min_avg_word_length, max_avg_word_length]``."""
        cfg = self.cfg
        mean = float(view.bare_word_lengths.mean())
        if cfg.min_avg_word_length is not None and mean < cfg.min_avg_word_length:
            return f"gopher_below_avg_threshold mean word length {mean:.2f} < {cfg.min_avg_word_length}"
        if cfg.max_avg_word_length is not None and mean > cfg.max_avg_word_length:
            return f"gopher_above_avg_threshold mean word length {mean:.2f} > {cfg.max_avg_word_length}"
        return None

    def _symbols(self, view: TextView) -> str | None:
        """Too many ``#`` and ellipses per word."""
        limit = self.cfg.max_symbol_word_ratio
        if limit is None:
            return None
        text, n = view.text, len(view.bare_words)
        symbols = text.count("#") + text.count("...") + text.count("…")
        if symbols / n > limit:
            return f"gopher_too_many_symbols {symbols / n:.3f} per word > {limit}"
        return None

    def _bullets(self, view: TextView) -> str | None:
        """Too many lines starting with a bullet."""
        return _too_many_lines(view, _bulleted, self.cfg.max_bullet_lines_ratio, "gopher_too_many_bullets")

    def _ellipses(self, view: TextView) -> str | None:
        """Too many lines ending in an ellipsis."""
        return _too_many_lines(
            view, _trailing_ellipsis, self.cfg.max_ellipsis_lines_ratio, "gopher_too_many_end_ellipsis"
        )

    def _alphabetic(self, view: TextView) -> str | None:
        """Too small a share of words holding a letter."""
        limit = self.cfg.max_non_alpha_words_ratio
        if limit is None:
            return None
        alpha = alphabetic_words(view) / max(len(view.words), 1)
        if alpha < limit:
            return f"gopher_below_alpha_threshold {alpha:.2f} of words alphabetic < {limit}"
        return None

    def _stop_words(self, view: TextView) -> str | None:
        """Fewer than ``min_stop_words`` stop words."""
        needed = self.cfg.min_stop_words
        if needed is None:
            return None
        # Stop words are common: counting stops once the threshold is reached (the count only
        # appears in the reason when it falls short, and then it is complete).
        stops = 0
        for w in view.bare_words:
            if w in self.stop_words:
                stops += 1
                if stops >= needed:
                    break
        if stops < needed:
            return f"gopher_enough_stop_words {stops} stop words < {needed}"
        return None
