"""The document view every rule reads: lines, paragraphs, words and word n-gram hashes, split once.

Splitting and hashing once per document, instead of in every filter, is where the time of a
rule-per-class pipeline goes; the repetition rule and MinHash share the same n-gram hashes.
"""

from __future__ import annotations

import re
import string
import zlib
from functools import cached_property

import numpy as np

UNDETERMINED_LANG = "und"  # ISO 639-2 "undetermined": language ID off or inconclusive
# ASCII punctuation plus the common typographic marks; stripped from word edges for word statistics
PUNCTUATION = string.punctuation + "“”‘’«»„‚‹›–—…·¡¿。，、；：？！「」『』（）《》【】"
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_CJK_WORDS = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]|[^\s\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")
_PARAGRAPH_BREAK = re.compile(r"\n{2,}")


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
