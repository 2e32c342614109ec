"""MinHash signatures over word n-gram shingles and their LSH band keys.

A document's shingles are the hashes of its runs of ``ngram`` consecutive casefolded words (the word
hashes come from :class:`lmforge.data.rules.TextView`, computed once per document). Each of the
``bands * rows`` hash functions is ``h(x) = (a * x + b) mod 2**64 >> 32`` with odd ``a``; the signature
holds the minimum over the shingles per function. Two documents with Jaccard similarity ``J`` share a
band with probability ``1 - (1 - J**rows) ** bands``: for the default 20 x 5 that is 0.05 at J = 0.3,
0.5 at J ≈ 0.51, 0.8 at J = 0.6 and 0.98 at J = 0.7; for FineWeb's 14 x 8, 0.5 at J ≈ 0.68, 0.65 at
J = 0.72, 0.92 at J = 0.8 and 0.99 at J = 0.85.
"""

from __future__ import annotations

import numpy as np

from lmforge.config import NearDedupConfig
from lmforge.data.rules.text_view import TextView, ngram_hashes

_BLOCK = 4096  # shingles per step: bounds the (permutations x shingles) matrix at 1024 x 4096 words


class MinHasher:
    """Signatures (``uint32[bands*rows]``) and band keys (``uint64[bands]``) for one configuration."""

    def __init__(self, cfg: NearDedupConfig) -> None:
        self.ngram, self.bands, self.rows = cfg.ngram, cfg.bands, cfg.rows
        self.permutations = cfg.bands * cfg.rows
        rng = np.random.default_rng(cfg.seed)
        self._a = rng.integers(1, 2**63, self.permutations, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self._b = rng.integers(0, 2**63, self.permutations, dtype=np.uint64)
        self._mix = rng.integers(1, 2**63, cfg.rows, dtype=np.uint64) * np.uint64(2) + np.uint64(1)

    def signature(self, word_hashes: np.ndarray) -> np.ndarray:
        """The MinHash signature of a document given its word hashes (all-ones for an empty document)."""
        return self.shingle_signature(ngram_hashes(word_hashes, self.ngram))

    def view_signature(self, view: TextView) -> np.ndarray:
        """:meth:`signature` of a document's words, reusing the n-gram hashes its rules computed."""
        return self.shingle_signature(view.ngram_hashes(self.ngram))

    def shingle_signature(self, shingles: np.ndarray) -> np.ndarray:
        """The per-permutation minimum over the shingle hashes (repeats need no removal: min ignores them)."""
        sig = np.full(self.permutations, np.iinfo(np.uint32).max, dtype=np.uint32)
        b = self._b[:, None]
        with np.errstate(over="ignore"):
            for start in range(0, len(shingles), _BLOCK):
                # permutations x shingles, reduced along the contiguous axis; the shift is monotonic, so it
                # is applied to the minimum instead of to every value
                hashed = np.multiply.outer(self._a, shingles[start : start + _BLOCK])
                hashed += b
                np.minimum(sig, (hashed.min(axis=1) >> np.uint64(32)).astype(np.uint32), out=sig)
        return sig

    def band_keys(self, signatures: np.ndarray) -> np.ndarray:
        """``uint64[n, bands]``: each band's ``rows`` signature values folded into one key.

        A band's key depends on its own columns only, so the columns of a group of whole bands (e.g.
        ``signatures[:, 5 * rows : 10 * rows]``) give the keys of those bands.
        """
        flat = np.atleast_2d(signatures)
        sig = flat.reshape(len(flat), flat.shape[1] // self.rows, self.rows)
        keys = np.empty((len(sig), sig.shape[1]), dtype=np.uint64)
        # One band at a time: the uint64 temporaries stay at n x rows instead of n x bands x rows.
        with np.errstate(over="ignore"):
            for band in range(sig.shape[1]):
                key = (sig[:, band].astype(np.uint64) * self._mix).sum(axis=1, dtype=np.uint64)
                key ^= key >> np.uint64(31)
                keys[:, band] = key
        return keys


def candidate_probability(jaccard: float, bands: int, rows: int) -> float:
    """Probability that two documents with this Jaccard similarity share at least one LSH band."""
    return 1.0 - (1.0 - jaccard**rows) ** bands
