"""Cleaning rules: each a small unit with named thresholds (from :mod:`lmforge.config`) and counters.

Every rule reads a :class:`TextView`, which splits a document into lines, paragraphs and words once
and caches the results; the rules and MinHash share those splits instead of re-tokenizing the same
text in every filter (the bulk of the time in rule-per-class pipelines). A rule's :meth:`Rule.check`
returns ``None`` to keep a document or a short reason string; :meth:`Rule.__call__` counts rejections
in ``removed`` and per reason in ``reasons``.

Thresholds and their defaults are the published ones: Gopher quality and repetition (Rae et al. 2021),
C4 (Raffel et al. 2020) and FineWeb's line rules (Penedo et al. 2024), as configured in datatrove's
FineWeb pipeline.
"""

from __future__ import annotations

import itertools
import re
import string
import zlib
from collections import Counter
from collections.abc import Iterator
from functools import cached_property
from typing import ClassVar

import numpy as np

from lmforge.config import C4Config, FineWebConfig, GopherQualityConfig, GopherRepetitionConfig

UNDETERMINED_LANG = "und"  # ISO 639-2 "undetermined": language ID off or inconclusive
# ASCII punctuation plus the common typographic marks; stripped from word edges for word statistics
PUNCTUATION = string.punctuation + "“”‘’«»„‚‹›–—…·¡¿。，、；：？！「」『』（）《》【】"
TERMINAL_PUNCTUATION = (".", "!", "?", '"', "'", "…", "。", "！", "？", "”", "’")
BULLETS = ("•", "●", "○", "▪", "‣", "◦", "-", "*")
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_CJK_WORDS = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]|[^\s\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")
_PARAGRAPH_BREAK = re.compile(r"\n{2,}")
_SENTENCE_END = re.compile(r"[.!?。！？]+[\"'”’)\]]*(?:\s|$)")
_CITATION = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]", re.IGNORECASE)
_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")


class _TokenHashCache(dict):
    """Word → crc32 memo: word frequencies are Zipfian, so most lookups hit (bounded size)."""

    limit = 1 << 20

    def __missing__(self, token: str) -> int:
        if len(self) >= self.limit:
            self.clear()
        value = self[token] = zlib.crc32(token.encode("utf-8"))
        return value


_TOKEN_HASHES = _TokenHashCache()


def stable_hashes(tokens: list[str]) -> np.ndarray:
    """A process-independent 32-bit hash per token (crc32), as ``uint64`` for n-gram arithmetic."""
    return np.fromiter(map(_TOKEN_HASHES.__getitem__, tokens), dtype=np.uint64, count=len(tokens))


# Odd 64-bit multipliers that mix the words of an n-gram into one hash (position-dependent).
_NGRAM_MULTIPLIERS = np.array(
    [0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93, 0xFF51AFD7ED558CCD]
    + [0xC4CEB9FE1A85EC53 + 2 * i for i in range(27)],
    dtype=np.uint64,
)


def _extend_ngrams(grams: np.ndarray, token_hashes: np.ndarray, k: int) -> np.ndarray:
    """The hashes of the ``k + 1``-grams from those of the ``k``-grams (``grams``; zeros for ``k = 0``).

    Word ``k`` of an n-gram only enters at step ``k``, so the (k+1)-gram hash at position ``i`` is one
    step on from the k-gram hash at ``i``: every n-gram size is one array operation from the one below.
    """
    count = len(token_hashes) - k
    with np.errstate(over="ignore"):
        out = grams[:count] + token_hashes[k:] * _NGRAM_MULTIPLIERS[k % len(_NGRAM_MULTIPLIERS)]
        out ^= out >> np.uint64(29)
    return out


def ngram_hashes(token_hashes: np.ndarray, n: int) -> np.ndarray:
    """A 64-bit hash of every run of ``n`` consecutive tokens (all tokens when there are fewer than ``n``)."""
    n = min(n, len(token_hashes))
    out = np.zeros(len(token_hashes), dtype=np.uint64)
    for k in range(n):
        out = _extend_ngrams(out, token_hashes, k)
    return out


class TextView:
    """One document split once: lines, paragraphs, words and their hashes, computed on first use.

    Args:
        text: the (normalized) document text.
        lang: ISO 639-1 code, or ``und``; Chinese is split into one word per Han character.
    """

    def __init__(self, text: str, lang: str = UNDETERMINED_LANG) -> None:
        self.text = text
        self.lang = lang

    def replace_text(self, text: str) -> None:
        """Point the view at new text (after a rule rewrote it), dropping every cached split."""
        lang = self.lang
        self.__dict__.clear()
        self.text, self.lang = text, lang

    @cached_property
    def lines(self) -> list[str]:
        return self.text.split("\n")

    @cached_property
    def nonempty_lines(self) -> list[str]:
        return [line for line in self.lines if line.strip()]

    @cached_property
    def paragraphs(self) -> list[str]:
        return [p for p in _PARAGRAPH_BREAK.split(self.text.strip()) if p]

    @cached_property
    def split_han(self) -> bool:
        """Whether ``words`` splits Han characters into single words (Chinese, or Han in the first 2000 chars)."""
        return self.lang == "zh" or _CJK.search(self.text[:2000]) is not None

    @cached_property
    def words(self) -> list[str]:
        """Whitespace-separated words (with their punctuation); Han characters are single words."""
        return _CJK_WORDS.findall(self.text) if self.split_han else self.text.split()

    @cached_property
    def bare_words(self) -> list[str]:
        """``words`` casefolded with punctuation stripped from both ends; pure-punctuation words dropped."""
        if self.split_han:
            stripped = (w.strip(PUNCTUATION).casefold() for w in self.words)
            return [w for w in stripped if w]
        # Casefolding the whole text once equals casefolding each word: casefold maps characters one by one,
        # never to or from whitespace, and leaves PUNCTUATION as it is (checked over all of Unicode in the tests).
        return [s for w in self.text.casefold().split() if (s := w.strip(PUNCTUATION))]

    @cached_property
    def word_hashes(self) -> np.ndarray:
        """:func:`stable_hashes` of ``bare_words``: shared by the repetition rules and MinHash."""
        return stable_hashes(self.bare_words)

    @cached_property
    def bare_word_lengths(self) -> np.ndarray:
        return np.fromiter(map(len, self.bare_words), dtype=np.int64, count=len(self.bare_words))

    @cached_property
    def bare_word_offsets(self) -> np.ndarray:
        """Cumulative ``bare_word_lengths`` from 0: the characters of words ``i..j-1`` are ``o[j] - o[i]``."""
        return np.concatenate(([0], np.cumsum(self.bare_word_lengths)))

    @cached_property
    def _ngrams(self) -> dict[int, np.ndarray]:
        """n-gram hashes by ``n`` computed so far (0: the zeros the first step starts from)."""
        return {0: np.zeros(len(self.word_hashes), dtype=np.uint64)}

    def ngram_hashes(self, n: int) -> np.ndarray:
        """:func:`ngram_hashes` of ``word_hashes``, each size built on the largest one already known."""
        known, hashes = self._ngrams, self.word_hashes
        n = min(n, len(hashes))
        if n not in known:
            k = max(k for k in known if k < n)
            grams = known[k]
            for step in range(k, n):
                grams = known[step + 1] = _extend_ngrams(grams, hashes, step)
        return known[n]


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
        raise NotImplementedError

    def __call__(self, view: TextView | str) -> str | None:
        if isinstance(view, str):
            view = TextView(view)
        if not self.applies(view):
            return None
        reason = self.check(view)
        if reason is not None:
            self.removed += 1
            self.reasons[reason.split(" ", 1)[0]] += 1
        return reason


class NonEmpty(Rule):
    """Drop documents that are empty after normalization."""

    name = "empty"

    def check(self, view: TextView) -> str | None:
        return None if view.text else "empty after normalization"


class MinChars(Rule):
    """Drop documents shorter than ``min_chars`` characters."""

    name = "min_chars"

    def __init__(self, min_chars: int) -> None:
        super().__init__()
        self.min_chars = min_chars

    def check(self, view: TextView) -> str | None:
        n = len(view.text)
        return None if n >= self.min_chars else f"{n} chars < {self.min_chars}"


class MinWords(Rule):
    """Drop documents with fewer than ``min_words`` whitespace-separated words."""

    name = "min_words"

    def __init__(self, min_words: int) -> None:
        super().__init__()
        self.min_words = min_words

    def check(self, view: TextView) -> str | None:
        n = len(view.words)
        return None if n >= self.min_words else f"{n} words < {self.min_words}"


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


def _runs(ordered: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, lengths)`` of the runs of equal values in the sorted array ``ordered`` (not empty)."""
    starts = np.flatnonzero(ordered[1:] != ordered[:-1]) + 1
    bounds = np.concatenate(([0], starts, [len(ordered)]))
    return bounds[:-1], np.diff(bounds)


def _first_occurrences(grams: np.ndarray) -> np.ndarray:
    """The position of each distinct value's first occurrence, in the order of the sorted values."""
    order = np.argsort(grams)
    starts, _ = _runs(grams[order])
    return np.minimum.reduceat(order, starts)


def _top_ngram_chars(
    grams: np.ndarray, offsets: np.ndarray, n: int, max_share: float | None = None, size: int = 1
) -> int:
    """:func:`top_ngram_chars` on n-gram hashes and word offsets (at least ``n`` words).

    With ``max_share``, returns 0 early when the result divided by ``size`` cannot exceed it (the rule's
    test): the most frequent n-gram's count times the longest n-gram's characters bounds it from above.
    """
    if len(grams) == 0:
        return 0
    _, counts = _runs(np.sort(grams))
    best = int(counts.max())
    if best < 2:
        return 0
    gram_chars = offsets[n:] - offsets[:-n]
    if max_share is not None and best * int(gram_chars.max()) / size <= max_share:
        return 0
    # The characters of an n-gram at its first occurrence.
    return int(gram_chars[_first_occurrences(grams)[counts == best]].max() * best)


def top_ngram_chars(hashes: np.ndarray, lengths: np.ndarray, n: int) -> int:
    """Characters of the most frequent word n-gram times its count (ties: the longest)."""
    if len(hashes) < n:
        return 0
    return _top_ngram_chars(ngram_hashes(hashes, n), np.concatenate(([0], np.cumsum(lengths))), n)


def _duplicate_ngram_chars(grams: np.ndarray, offsets: np.ndarray, n: int, upper_bound: int | None = None) -> int:
    """:func:`duplicate_ngram_chars` on n-gram hashes and word offsets."""
    ordered = np.sort(grams)
    if not (ordered[1:] == ordered[:-1]).any():
        return 0
    if upper_bound is not None:
        # Every counted repeat is a non-first occurrence, so their total is an upper bound: the exact,
        # sequential count is only needed when the bound crosses the threshold.
        repeat = np.ones(len(grams), dtype=bool)
        repeat[_first_occurrences(grams)] = False
        at = np.flatnonzero(repeat)
        if int((offsets[at + n] - offsets[at]).sum()) <= upper_bound:
            return 0
    hashes = grams.tolist()
    cum = offsets.tolist()
    seen: set[int] = set()
    repeated = i = 0
    last = len(hashes)
    while i < last:
        gram = hashes[i]
        if gram in seen:
            repeated += cum[i + n] - cum[i]
            i += n
        else:
            seen.add(gram)
            i += 1
    return repeated


def duplicate_ngram_chars(hashes: np.ndarray, lengths: np.ndarray, n: int, upper_bound: int | None = None) -> int:
    """Characters covered by repeated word n-grams, counting a repeat's words once (Gopher's rule).

    With ``upper_bound``, returns 0 early when the value cannot exceed it (the caller only compares).
    """
    if len(hashes) < n:
        return 0
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    return _duplicate_ngram_chars(ngram_hashes(hashes, n), offsets, n, upper_bound)


class GopherRepetition(Rule):
    """Gopher repetition: duplicated lines and paragraphs, top n-grams, duplicated n-grams."""

    name = "gopher_repetition"

    def __init__(self, cfg: GopherRepetitionConfig) -> None:
        super().__init__(cfg.languages)
        self.cfg = cfg

    def check(self, view: TextView) -> str | None:
        cfg = self.cfg
        size = max(len(view.text), 1)
        paragraphs = view.paragraphs
        if paragraphs and (cfg.dup_para_frac is not None or cfg.dup_para_char_frac is not None):
            dups, chars = duplicate_share(paragraphs)
            if cfg.dup_para_frac is not None and dups / len(paragraphs) > cfg.dup_para_frac:
                return f"dup_para_frac {dups / len(paragraphs):.2f} > {cfg.dup_para_frac}"
            if cfg.dup_para_char_frac is not None and chars / size > cfg.dup_para_char_frac:
                return f"dup_para_char_frac {chars / size:.2f} > {cfg.dup_para_char_frac}"
        lines = view.nonempty_lines
        if lines and (cfg.dup_line_frac is not None or cfg.dup_line_char_frac is not None):
            dups, chars = duplicate_share(lines)
            if cfg.dup_line_frac is not None and dups / len(lines) > cfg.dup_line_frac:
                return f"dup_line_frac {dups / len(lines):.2f} > {cfg.dup_line_frac}"
            if cfg.dup_line_char_frac is not None and chars / size > cfg.dup_line_char_frac:
                return f"dup_line_char_frac {chars / size:.2f} > {cfg.dup_line_char_frac}"
        words, offsets = len(view.word_hashes), view.bare_word_offsets
        for rule in cfg.top_n_grams:
            if words < rule.n:
                continue
            top = _top_ngram_chars(view.ngram_hashes(rule.n), offsets, rule.n, rule.max_fraction, size)
            if top / size > rule.max_fraction:
                return f"top_{rule.n}_gram {top / size:.2f} of chars > {rule.max_fraction}"
        for rule in cfg.dup_n_grams:
            if words < rule.n:
                continue
            bound = int(rule.max_fraction * size)
            share = _duplicate_ngram_chars(view.ngram_hashes(rule.n), offsets, rule.n, bound) / size
            if share > rule.max_fraction:
                return f"duplicated_{rule.n}_n_grams {share:.2f} of chars > {rule.max_fraction}"
        return None


def _at_least(items: Iterator[object], n: int) -> bool:
    """Whether ``items`` yields at least ``n`` items (consuming no more than ``n``)."""
    return sum(1 for _ in itertools.islice(items, n)) == n


class C4Lines(Rule):
    """C4: drop boilerplate lines (short, javascript, policy, giant words), then documents that are code,
    lorem ipsum or have too few sentences left. Rewrites ``view`` in place when it drops lines."""

    name = "c4"

    def __init__(self, cfg: C4Config) -> None:
        super().__init__(cfg.languages)
        self.cfg = cfg
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


class FineWebLines(Rule):
    """FineWeb: share of lines ending in punctuation, of short lines, of duplicated-line characters,
    and newlines per word."""

    name = "fineweb"

    def __init__(self, cfg: FineWebConfig) -> None:
        super().__init__(cfg.languages)
        self.cfg = cfg

    def check(self, view: TextView) -> str | None:
        cfg = self.cfg
        lines = view.nonempty_lines
        if not lines:
            return "fineweb_empty"
        if cfg.line_punct_thr is not None:
            ratio = sum(line.endswith(TERMINAL_PUNCTUATION) for line in lines) / len(lines)
            if ratio < cfg.line_punct_thr and not (ratio == 0 and cfg.line_punct_exclude_zero):
                return f"line_punct_ratio {ratio:.2f} < {cfg.line_punct_thr}"
        if cfg.short_line_thr is not None:
            ratio = sum(len(line) <= cfg.short_line_length for line in lines) / len(lines)
            if ratio > cfg.short_line_thr:
                return f"short_line_ratio {ratio:.2f} > {cfg.short_line_thr}"
        if cfg.char_duplicates_ratio is not None:
            chars = duplicate_share(lines)[1] / max(len(view.text) - view.text.count("\n"), 1)
            if chars > cfg.char_duplicates_ratio:
                return f"char_dup_ratio {chars:.3f} > {cfg.char_duplicates_ratio}"
        if cfg.new_line_ratio is not None:
            ratio = view.text.count("\n") / max(len(view.words), 1)
            if ratio > cfg.new_line_ratio:
                return f"list_ratio {ratio:.2f} newlines per word > {cfg.new_line_ratio}"
        return None
