"""The ``dedup_exact_part`` stage: the exact duplicates among one part of the documents."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lmforge.config import CleanConfig
from lmforge.data.dedup_files import (
    BLOCK_ROWS,
    EXACT_PART_KIND,
    at_least_one,
    close_files,
    part_of,
    signature_files,
    write_pairs,
)
from lmforge.errors import ConfigError
from lmforge.results import StageResult


def run(cfg: CleanConfig, *, shards: Sequence[str | Path], part: int, parts: int, exact: str | Path) -> StageResult:
    """The ``dedup_exact_part`` stage: exact duplicates among the documents whose digest falls in ``part``.

    As in ``dedup_shards``, the document with the smallest key keeps its text; every other copy is written to
    ``exact`` as a ``(key, duplicate_of)`` pair.

    Raises:
        ConfigError: ``part`` is not one of ``0 .. parts-1``.
    """
    at_least_one(parts=parts)
    if not 0 <= part < parts:
        raise ConfigError(f"part: must be in 0 .. {parts - 1} (parts={parts}), got {part}")
    found_keys, found_digests = [], []
    if cfg.exact_dedup:
        for shard_dir in shards:
            files = signature_files(shard_dir)
            for start in range(0, len(files["keys"]), BLOCK_ROWS):
                digests = files["exact"].rows(start, start + BLOCK_ROWS)
                mine = part_of(digests[:, :8].copy().view(np.uint64).ravel(), parts) == part
                found_keys.append(files["keys"].rows(start, start + BLOCK_ROWS)[mine])
                found_digests.append(digests[mine])
            close_files(files)
    pairs: list[tuple[int, int]] = []
    if found_keys:
        keys, digests = np.concatenate(found_keys), np.concatenate(found_digests)
        order = np.argsort(keys, kind="stable")
        first: dict[bytes, int] = {}
        for key, digest in zip(keys[order].tolist(), digests[order], strict=True):
            kept = first.setdefault(digest.tobytes(), key)
            if kept != key:
                pairs.append((key, kept))
    return write_pairs(EXACT_PART_KIND, pairs, cfg, {"part": [part, parts]}, exact)
