"""The ``dedup_union`` stage: the partitioned steps' pairs joined into the plan ``dedup_shards`` writes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lmforge.config import CleanConfig
from lmforge.data.dedup_files import BAND_PART_KIND, EXACT_PART_KIND, read_parts, write_plan
from lmforge.formats.dedup import (
    EXACT_RULE,
    NEAR_RULE,
    SIGNATURES,
)
from lmforge.results import StageResult


def run(
    cfg: CleanConfig,
    *,
    shards: Sequence[str | Path],
    exact: Sequence[str | Path],
    pairs: Sequence[str | Path],
    plan: str | Path,
) -> StageResult:
    """The ``dedup_union`` stage: join the parts' pairs into the ``dedup-plan`` of ``dedup_shards``.

    Union-find over the documents named in pairs only; a near-duplicate cluster keeps its smallest key, as
    ``dedup_shards`` does. ``shards`` are read only for the document count.

    Raises:
        InputDataError: the ``exact`` or the band ``pairs`` artifacts are not one complete fan-out each.
    """
    bands = cfg.near_dedup.bands
    removed: dict[int, tuple[str, int]] = {}
    for key, kept in read_parts(exact, EXACT_PART_KIND, bands).tolist():
        removed[key] = (EXACT_RULE, kept)
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        root = x
        while parent.get(root, root) != root:
            root = parent[root]
        while parent.get(x, x) != root:
            parent[x], x = root, parent[x]
        return root

    for other, head in read_parts(pairs, BAND_PART_KIND, bands).tolist():
        a, b = find(other), find(head)
        if a != b:
            parent[max(a, b)] = min(a, b)
    for key in list(parent):
        root = find(key)
        if root != key:
            removed[key] = (NEAR_RULE, root)
    docs = sum(len(np.load(Path(d, SIGNATURES["keys"]), mmap_mode="r")) for d in shards)
    inputs = {f"part_{i:05d}": str(d) for i, d in enumerate([*exact, *pairs])}
    return write_plan(cfg, removed, docs, inputs, plan)
