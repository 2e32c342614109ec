"""Sentence-aware chunking: whole sentences packed into chunks of at most ``chunk_size`` tokens.

Text is split into sentences once by spaCy's rule-based ``sentencizer`` on a blank pipeline (no model
download): ``spacy.blank("en")`` or ``spacy.blank("zh")`` with character segmentation, which ends
sentences at 。！？ as well. Sentences are then packed greedily, in order, into chunks whose token count
under the given Hugging Face tokenizer (special tokens not added) is at most ``chunk_size``. A sentence
longer than that is cut at token boundaries that fall between characters; nothing is dropped.

Each piece is counted with the whitespace before it, as it appears inside a chunk, but the count of a
concatenation is not always the sum of its parts, so every chunk is re-encoded: one over the limit is
halved (several sentences) or cut (one sentence) and checked again, so no chunk ever exceeds the limit.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Literal

from transformers import PreTrainedTokenizerBase

from lmforge.config import MIN_CHUNK_TOKENS, ChunkLang
from lmforge.data.rules import UNDETERMINED_LANG

if TYPE_CHECKING:
    from spacy.language import Language

SentenceLang = Literal["en", "zh"]
PIPE_BATCH = 64


@functools.cache
def sentencizer(lang: SentenceLang) -> Language:
    """A blank spaCy pipeline for ``lang`` with the rule-based sentencizer, built once per language."""
    import spacy

    # "char" segmentation needs neither jieba nor pkuseg (and no download); spaCy's default, set explicitly.
    config = {"nlp": {"tokenizer": {"segmenter": "char"}}} if lang == "zh" else {}
    nlp = spacy.blank(lang, config=config)
    nlp.add_pipe("sentencizer")
    # max_length guards the memory of parsers and NER; tokenizer + sentencizer need about as much per
    # character as the HF encode of the same document.
    nlp.max_length = sys.maxsize
    return nlp


def resolve_lang(setting: ChunkLang, record_lang: str | None, text: str) -> SentenceLang:
    """The sentence rules for one text.

    ``setting`` when it is ``en`` or ``zh``; for ``auto`` the record's language (from language ID) when
    known, else ``zh`` when most letters of the text's first 1000 characters are Han.
    """
    if setting != "auto":
        return setting
    if record_lang is not None and record_lang != UNDETERMINED_LANG:
        return "zh" if record_lang == "zh" else "en"
    sample = text[:1000]
    letters = sum(c.isalpha() for c in sample)
    han = sum("\u4e00" <= c <= "\u9fff" or "\u3400" <= c <= "\u4dbf" for c in sample)
    return "zh" if letters and 2 * han > letters else "en"


@dataclass(frozen=True)
class Chunk:
    """A chunk of text, its token count, and whether it ends inside a sentence (a forced cut)."""

    text: str
    tokens: int
    forced: bool


@dataclass(frozen=True)
class _Candidate:
    """A chunk to check: ``text[bounds[0]:bounds[-1]]``, made of the sentences between consecutive bounds."""

    doc: int
    bounds: tuple[int, ...]
    forced: bool


class SentenceChunker:
    """Pack whole sentences into chunks of at most ``chunk_size`` tokens of ``tokenizer``.

    Args:
        tokenizer: a fast Hugging Face tokenizer (offsets are needed to cut long sentences).
        chunk_size: the most tokens in a chunk, at least ``MIN_CHUNK_TOKENS`` so any one character fits.
        lang: ``en``, ``zh``, or ``auto`` (see :func:`resolve_lang`).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chunk_size: int, lang: ChunkLang = "auto") -> None:
        if chunk_size < MIN_CHUNK_TOKENS:
            raise ValueError(f"chunk_size must be at least {MIN_CHUNK_TOKENS} tokens, got {chunk_size}")
        if not tokenizer.is_fast:
            raise ValueError(f"sentence chunking needs a fast tokenizer (offsets); {type(tokenizer).__name__} is not")
        if lang not in ("en", "zh", "auto"):
            raise ValueError(f"lang must be en, zh or auto, got {lang!r}")
        # The Rust tokenizer itself: the same ids as calling ``tokenizer``, without its per-call overhead.
        self.backend = tokenizer.backend_tokenizer
        self.chunk_size = chunk_size
        self.lang = lang

    def chunk(self, text: str, record_lang: str | None = None) -> list[Chunk]:
        """The chunks of one text, in order."""
        return self.chunk_many([text], [record_lang])[0]

    def chunk_many(self, texts: Sequence[str], record_langs: Sequence[str | None] | None = None) -> list[list[Chunk]]:
        """The chunks of each text, in order; ``record_langs`` are the texts' detected languages, if any."""
        langs = [
            resolve_lang(self.lang, record_lang, text)
            for text, record_lang in zip(texts, record_langs or [None] * len(texts), strict=True)
        ]
        bounds = self._sentence_bounds(texts, langs)
        pieces = [(doc, b[i], b[i + 1]) for doc, b in enumerate(bounds) for i in range(len(b) - 1)]
        counts = self._count([texts[doc][start:end] for doc, start, end in pieces])

        # Greedy packing by the pieces' counts; a piece over the limit alone makes a candidate of its own.
        candidates: list[_Candidate] = []
        group_doc, group, total = -1, [0], 0
        for (doc, start, end), count in zip(pieces, counts, strict=True):
            if doc != group_doc or total + count > self.chunk_size:
                if len(group) > 1:
                    candidates.append(_Candidate(group_doc, tuple(group), forced=False))
                group_doc, group, total = doc, [start], 0
            group.append(end)
            total += count
        if len(group) > 1:
            candidates.append(_Candidate(group_doc, tuple(group), forced=False))

        chunks: list[list[tuple[int, Chunk]]] = [[] for _ in texts]
        while candidates:
            chunk_texts = [texts[c.doc][c.bounds[0] : c.bounds[-1]].strip() for c in candidates]
            retry: list[_Candidate] = []
            for candidate, text, count in zip(candidates, chunk_texts, self._count(chunk_texts), strict=True):
                if not text:
                    continue
                if count <= self.chunk_size:
                    chunks[candidate.doc].append((candidate.bounds[0], Chunk(text, count, candidate.forced)))
                else:
                    retry += self._divide(texts[candidate.doc], candidate)
            candidates = retry
        return [[chunk for _, chunk in sorted(doc_chunks, key=lambda c: c[0])] for doc_chunks in chunks]

    def _sentence_bounds(self, texts: Sequence[str], langs: Sequence[SentenceLang]) -> list[list[int]]:
        """Per text, the char positions where sentences end (trailing whitespace excluded), after a leading 0.

        The piece between two bounds is one sentence with the whitespace before it.
        """
        bounds: list[list[int]] = [[0] for _ in texts]
        for lang in sorted(set(langs)):
            indices = [i for i, text_lang in enumerate(langs) if text_lang == lang]
            docs = sentencizer(lang).pipe((texts[i] for i in indices), batch_size=PIPE_BATCH)
            for i, doc in zip(indices, docs, strict=True):
                text = texts[i]
                for sentence in doc.sents:
                    end = sentence.end_char
                    while end > bounds[i][-1] and text[end - 1].isspace():
                        end -= 1
                    if end > bounds[i][-1]:
                        bounds[i].append(end)
        return bounds

    def _count(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        return [len(encoding.ids) for encoding in self.backend.encode_batch(texts, add_special_tokens=False)]

    def _divide(self, text: str, candidate: _Candidate) -> list[_Candidate]:
        """Split a chunk over the limit: several sentences in two halves, one sentence at token boundaries."""
        bounds = candidate.bounds
        if len(bounds) > 2:
            middle = len(bounds) // 2
            return [
                _Candidate(candidate.doc, bounds[: middle + 1], forced=False),
                _Candidate(candidate.doc, bounds[middle:], forced=candidate.forced),
            ]
        raw = text[bounds[0] : bounds[1]]
        start = bounds[0] + len(raw) - len(raw.lstrip())
        sentence = raw.strip()
        offsets = self.backend.encode(sentence, add_special_tokens=False).offsets
        cuts = [0]  # char positions in ``sentence``
        first = 0  # the first token of the current part
        while len(offsets) - first > self.chunk_size:
            first = self._cut_token(sentence, offsets, first, cuts[-1])
            cuts.append(offsets[first - 1][1])
        cuts.append(len(sentence))
        return [
            _Candidate(candidate.doc, (start + a, start + b), forced=candidate.forced if b == len(sentence) else True)
            for a, b in pairwise(cuts)
        ]

    def _cut_token(self, sentence: str, offsets: list[tuple[int, int]], first: int, floor: int) -> int:
        """The token to start the next part at, at most ``chunk_size`` tokens after ``first``.

        Only between two characters (byte-level tokens may split one), after char ``floor`` and before the
        end, so every part is shorter than the sentence; a word boundary in the second half of the window is
        preferred over a cut inside a word.
        """
        boundaries = [
            j
            for j in range(first + self.chunk_size, first, -1)
            if offsets[j - 1][1] <= offsets[j][0] and floor < offsets[j - 1][1] < len(sentence)
        ]
        if not boundaries:
            raise ValueError(
                f"cannot cut {sentence[:40]!r}... into chunks of {self.chunk_size} tokens: one character encodes "
                "to more tokens than that"
            )
        half = first + self.chunk_size // 2
        words = (j for j in boundaries if j > half and sentence[offsets[j - 1][1]].isspace())
        return next(words, boundaries[0])
