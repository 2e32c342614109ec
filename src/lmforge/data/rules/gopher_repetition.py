"""Gopher's repetition rules (Rae et al. 2021, "Scaling Language Models"; datatrove's
``GopherRepetitionFilter``): drop documents with too many duplicated lines or paragraphs, too large a
share of characters in the most frequent word n-gram (by default n = 2..4) or in repeated n-grams
(n = 5..10).

The n-gram statistics run on the hashes of :meth:`TextView.ngram_hashes`, shared with MinHash.
"""

from __future__ import annotations

import numpy as np

from lmforge.config import GopherRepetitionConfig
from lmforge.data.rules.base import ConfiguredRule, duplicate_share
from lmforge.data.rules.text_view import TextView, ngram_hashes


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


def _repeated(items: list[str], kind: str, frac: float | None, char_frac: float | None, size: int) -> str | None:
    """The reason when too many ``items`` (paragraphs or lines) repeat an earlier one, by count or by characters."""
    if not items or (frac is None and char_frac is None):
        return None
    dups, chars = duplicate_share(items)
    if frac is not None and dups / len(items) > frac:
        return f"dup_{kind}_frac {dups / len(items):.2f} > {frac}"
    if char_frac is not None and chars / size > char_frac:
        return f"dup_{kind}_char_frac {chars / size:.2f} > {char_frac}"
    return None


class GopherRepetition(ConfiguredRule[GopherRepetitionConfig]):
    """Gopher repetition: duplicated lines and paragraphs, top n-grams, duplicated n-grams."""

    name = "gopher_repetition"

    def check(self, view: TextView) -> str | None:
        cfg = self.cfg
        size = max(len(view.text), 1)
        reason = _repeated(view.paragraphs, "para", cfg.dup_para_frac, cfg.dup_para_char_frac, size)
        if reason is None:  # the lines are only split when the paragraphs pass
            reason = _repeated(view.nonempty_lines, "line", cfg.dup_line_frac, cfg.dup_line_char_frac, size)
        if reason is not None:
            return reason
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
