"""The ``dedup_band_part`` stage: the confirmed near-duplicate pairs of one LSH band group and part."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lmforge.config import CleanConfig, NearDedupConfig
from lmforge.data.dedup_files import (
    BAND_PART_KIND,
    BLOCK_ROWS,
    EXACT_PART_KIND,
    ROW_BITS,
    NpyRows,
    agreement,
    at_least_one,
    band_ranges,
    buckets,
    close_files,
    part_of,
    read_parts,
    signature_at,
    signature_files,
    write_pairs,
)
from lmforge.errors import ConfigError
from lmforge.results import StageResult


def run(
    cfg: CleanConfig,
    *,
    shards: Sequence[str | Path],
    exact: Sequence[str | Path],
    band_task: int,
    band_groups: int,
    parts: int,
    pairs: str | Path,
) -> StageResult:
    """The ``dedup_band_part`` stage: confirmed candidate pairs of one band group and part of its bucket keys.

    Band task ``band_task`` (from ``plan_dedup``) is LSH band group ``band_task // parts`` of
    ``band_groups`` and bucket-key part ``band_task % parts``. The documents the ``exact`` parts remove are
    left out, as ``dedup_shards`` does. In every bucket (documents sharing a band key) the one with the smallest
    key is the head, and each other member whose signature agrees with the head's on at least
    ``near_dedup.min_similarity`` of the positions pairs with it.

    Raises:
        ConfigError: ``band_task`` is outside the plan of ``band_groups`` × ``parts`` tasks.
        InputDataError: the ``exact`` parts are not one complete exact fan-out.
    """
    near = cfg.near_dedup
    at_least_one(band_groups=band_groups, parts=parts)
    ranges = band_ranges(near.bands, band_groups)
    if not 0 <= band_task < len(ranges) * parts:
        raise ConfigError(
            f"band_task: must be in 0 .. {len(ranges) * parts - 1} ({len(ranges)} band groups × {parts} parts), "
            f"got {band_task}"
        )
    group, part = divmod(band_task, parts)
    lo, hi = ranges[group]
    found_pairs: list[tuple[int, int]] = []
    removed = {int(k) for k in read_parts(exact, EXACT_PART_KIND, near.bands)[:, 0]}
    if near.enabled:
        files = [signature_files(d) for d in shards]
        for blocks in _band_entries(files, near, removed, (lo, hi), part, parts):
            table = np.concatenate(blocks) if blocks else np.empty((0, 3), np.int64)
            blocks.clear()
            found_pairs += _confirmed_pairs(table, files, near.min_similarity)
        for shard_files in files:
            close_files(shard_files)
    extra = {"bands": [lo, hi], "part": [part, parts]}
    return write_pairs(BAND_PART_KIND, found_pairs, cfg, extra, pairs)


def _band_entries(
    files: list[dict[str, NpyRows]],
    near: NearDedupConfig,
    removed: set[int],
    bands: tuple[int, int],
    part: int,
    parts: int,
) -> list[list[np.ndarray]]:
    """Per band of ``[first, last)`` ``bands``, blocks of ``(band key, document key, where: shard << 40 | row)`` rows
    (24 bytes each) of the documents whose band key falls in ``part``, those in ``removed`` left out."""
    from lmforge.data.minhash import MinHasher

    hasher = MinHasher(near)
    lo, hi = bands
    found: list[list[np.ndarray]] = [[] for _ in range(hi - lo)]
    for shard, sig in enumerate(files):
        for start in range(0, len(sig["keys"]), BLOCK_ROWS):
            keys = sig["keys"].rows(start, start + BLOCK_ROWS)
            alive = np.fromiter((k not in removed for k in keys.tolist()), bool, len(keys))
            columns = sig["minhash"].rows(start, start + BLOCK_ROWS)[:, lo * near.rows : hi * near.rows]
            band_keys = hasher.band_keys(columns)
            where = (shard << ROW_BITS) + np.arange(start, start + len(keys), dtype=np.int64)
            for b in range(hi - lo):
                mine = alive & (part_of(band_keys[:, b], parts) == part)
                found[b].append(np.stack([band_keys[mine, b].view(np.int64), keys[mine], where[mine]], axis=1))
    return found


def _confirmed_pairs(
    table: np.ndarray, files: list[dict[str, NpyRows]], min_similarity: float
) -> list[tuple[int, int]]:
    """``(key, head's key)`` of every member of a bucket of one band's ``table`` (rows of :func:`_band_entries`)
    but its head (the smallest key), when its signature agrees with the head's on ``min_similarity`` of it."""
    table = table[np.lexsort((table[:, 1], table[:, 0]))]  # by band key, then document key
    pairs: list[tuple[int, int]] = []
    for s, e in buckets(table[:, 0]):
        head = table[s]
        head_sig = signature_at(files, int(head[2])) if min_similarity > 0 else None
        for other in table[s + 1 : e]:
            if head_sig is not None and agreement(head_sig, signature_at(files, int(other[2]))) < min_similarity:
                continue
            pairs.append((int(other[1]), int(head[1])))
    return pairs
