"""The ``dedup_shards`` stage: exact and MinHash LSH dedup over every cleaned shard's signatures, in one step."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lmforge.config import CleanConfig, NearDedupConfig
from lmforge.data.dedup_files import agreement, buckets, write_plan
from lmforge.errors import InputDataError
from lmforge.formats.dedup import (
    EXACT_RULE,
    NEAR_RULE,
    load_signatures,
)
from lmforge.results import StageResult


class _Clusters:
    """Union-find whose root is always the smallest key of its set (the document to keep)."""

    def __init__(self, keys: np.ndarray) -> None:
        self.parent = list(range(len(keys)))
        self.keys = keys.tolist()

    def find(self, i: int) -> int:
        parent = self.parent
        root = i
        while parent[root] != root:
            root = parent[root]
        while parent[i] != root:
            parent[i], i = root, parent[i]
        return root

    def union(self, i: int, j: int) -> None:
        ri, rj = self.find(i), self.find(j)
        if ri != rj:
            if self.keys[rj] < self.keys[ri]:
                ri, rj = rj, ri
            self.parent[rj] = ri


def plan_removals(
    cfg: CleanConfig, keys: np.ndarray, exact: np.ndarray, minhash: np.ndarray
) -> dict[int, tuple[str, int]]:
    """``{removed key: (rule, key of the kept document)}`` over all documents of all shards."""
    if not (keys[:-1] <= keys[1:]).all():  # shards come in corpus order; copying the arrays is rarely needed
        order = np.argsort(keys, kind="stable")
        keys, exact, minhash = keys[order], exact[order], minhash[order]
    removed: dict[int, tuple[str, int]] = {}
    alive = np.ones(len(keys), dtype=bool)
    if cfg.exact_dedup and len(keys):
        _remove_exact(keys, exact, alive, removed)
    if cfg.near_dedup.enabled and alive.sum() > 1:
        _remove_near(cfg.near_dedup, keys, minhash, alive, removed)
    return removed


def _remove_exact(keys: np.ndarray, exact: np.ndarray, alive: np.ndarray, removed: dict[int, tuple[str, int]]) -> None:
    """Mark every document whose digest an earlier one has as removed (and no longer ``alive``)."""
    first: dict[bytes, int] = {}
    raw = exact.tobytes()
    for i, digest in enumerate(raw[j : j + 16] for j in range(0, len(raw), 16)):
        kept = first.setdefault(digest, i)
        if kept != i:
            removed[int(keys[i])] = (EXACT_RULE, int(keys[kept]))
            alive[i] = False


def _remove_near(
    near: NearDedupConfig,
    keys: np.ndarray,
    minhash: np.ndarray,
    alive: np.ndarray,
    removed: dict[int, tuple[str, int]],
) -> None:
    """Cluster the ``alive`` documents by LSH band collisions; mark all but each cluster's smallest key removed."""
    from lmforge.data.minhash import MinHasher

    idx = np.flatnonzero(alive)
    bands = MinHasher(near).band_keys(minhash if len(idx) == len(minhash) else minhash[idx])
    clusters = _Clusters(keys[idx])

    def similar(i: int, j: int) -> bool:
        return near.min_similarity <= 0 or agreement(minhash[idx[i]], minhash[idx[j]]) >= near.min_similarity

    for b in range(bands.shape[1]):
        column = bands[:, b]
        by_value = np.argsort(column, kind="stable")
        for s, e in buckets(column[by_value]):
            head, *others = by_value[s:e].tolist()
            for other in others:
                if similar(head, other):
                    clusters.union(head, other)
    for local in range(len(idx)):
        root = clusters.find(local)
        if root != local:
            removed[int(keys[idx[local]])] = (NEAR_RULE, int(keys[idx[root]]))


def run(cfg: CleanConfig, *, shards: Sequence[str | Path], plan: str | Path) -> StageResult:
    """The global dedup step: read every shard's signatures, write the keys to remove to ``plan``."""
    if not shards:
        raise InputDataError("dedup: no cleaned shards given")
    loaded = [load_signatures(d) for d in shards]
    keys = np.concatenate([k for k, _, _ in loaded])
    if len(np.unique(keys)) != len(keys):
        raise InputDataError("dedup: the shards overlap (a document key occurs twice); were they split correctly?")
    exact = np.concatenate([e for _, e, _ in loaded])
    perms = cfg.near_dedup.bands * cfg.near_dedup.rows
    minhash = np.concatenate([m for _, _, m in loaded]) if len(keys) else np.empty((0, perms), np.uint32)
    del loaded  # the per-shard arrays are copied above; free them before planning
    removed = plan_removals(cfg, keys, exact, minhash)
    return write_plan(cfg, removed, len(keys), {f"shard_{i:05d}": str(d) for i, d in enumerate(shards)}, plan)
