"""Dedup's shared parts: the signature files of cleaned shards read a block of rows at a time, the pair
files of the partitioned steps, the LSH bucket scan and the ``dedup-plan`` writer.

The cleaning fan-out dedups in three steps:

1. ``clean_shard`` writes each shard's surviving documents and, per document, its global corpus position
   ``key``, its exact digest and its MinHash signature (:data:`~lmforge.formats.dedup.SIGNATURES`).
2. ``dedup_shards`` loads the signatures of every shard (about 430 bytes per document at 20 x 5), removes
   exact duplicates, clusters the rest by LSH band collisions (union-find) and keeps, in every cluster,
   the document with the smallest ``key``, i.e. the first in corpus order. It writes the removed keys.
3. ``merge_shards`` drops the removed keys while merging the shards in key order.

Because ``key`` does not depend on how the corpus was split, 1 shard and N shards give the same output.

Past one pod's memory, the DAG runs step 2 as a fan-out of its own (``plan_dedup``, ``dedup_exact_part``,
``dedup_band_part``, ``dedup_union``), whose steps each hold one part of the signatures and which writes the same
plan as ``dedup_shards``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lmforge.artifacts import read_manifest, staged_output, write_manifest
from lmforge.config import CleanConfig
from lmforge.errors import ConfigError, InputDataError
from lmforge.formats.cleaned import SHARD_KIND
from lmforge.formats.dedup import (
    EXACT_RULE,
    KIND,
    NEAR_RULE,
    REMOVED,
    REMOVED_SCHEMA,
    SIGNATURES,
)
from lmforge.results import StageResult

log = logging.getLogger("lmforge.dedup")


def buckets(values: np.ndarray) -> Iterator[tuple[int, int]]:
    """``[start, end)`` of every run of two or more equal values in the sorted ``values`` (an LSH bucket)."""
    if not len(values):
        return
    starts = np.flatnonzero(np.concatenate(([True], values[1:] != values[:-1])))
    ends = np.append(starts[1:], len(values))
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        if e - s >= 2:
            yield s, e


def agreement(signature: np.ndarray, other: np.ndarray) -> float:
    """The share of MinHash positions on which two signatures agree (an estimate of their Jaccard similarity)."""
    return float(np.mean(signature == other))


def write_plan(
    cfg: CleanConfig, removed: dict[int, tuple[str, int]], docs: int, inputs: dict[str, str], output_dir: str | Path
) -> StageResult:
    """Write the ``dedup-plan`` artifact (``removed.parquet``, stats, manifest) that :func:`read_removed` reads."""
    clusters: dict[str, set[int]] = defaultdict(set)
    for rule, kept in removed.values():
        clusters[rule].add(kept)
    metrics: dict[str, float] = {
        "docs": docs,
        "removed_exact_dedup": sum(r == EXACT_RULE for r, _ in removed.values()),
        "removed_near_dedup": sum(r == NEAR_RULE for r, _ in removed.values()),
        "exact_clusters": len(clusters[EXACT_RULE]),
        "near_clusters": len(clusters[NEAR_RULE]),
    }
    with staged_output(output_dir) as stage:
        rows = sorted(removed.items())
        table = pa.table(
            {
                "key": [k for k, _ in rows],
                "rule": [r for _, (r, _) in rows],
                "duplicate_of": [d for _, (_, d) in rows],
            },
            schema=REMOVED_SCHEMA,
        )
        pq.write_table(table, stage / REMOVED, compression="zstd")
        (stage / "stats.json").write_text(json.dumps(metrics, indent=2), encoding="utf-8")
        write_manifest(stage, KIND, inputs=inputs, config=cfg.model_dump(), metrics=metrics)
    log.debug(
        "dedup over %d inputs: %d documents, %d exact and %d near duplicates removed",
        len(inputs),
        metrics["docs"],
        metrics["removed_exact_dedup"],
        metrics["removed_near_dedup"],
    )
    return StageResult(metrics=metrics, summary={"output": str(output_dir)})


# -- past one pod: the same plan from partitioned steps ---------------------------------------------------
#
# plan_parts          (band group and part counts)        -> the index lists of the two fan-outs
# exact_part ×P       (digests hashed into P parts)       -> exact duplicates: (key, duplicate_of)
# band_part ×G·P      (band task t = group·P + part: G     -> confirmed candidate pairs (head, other)
#                      groups of LSH bands, band keys         within each band bucket, exact duplicates left out
#                      hashed into P parts)
# union               (union-find over the pairs only)    -> the same ``dedup-plan`` as ``dedup_shards``
#
# Each step reads every shard's signature files a block of rows at a time (pread, not a memory map) and holds
# only the rows of its part: an exact part ~24 bytes per document of its part plus a dict entry, a band part
# ~(24 + 24) bytes per document and band of its group (entry and sort copy).
# The union step holds the pairs and the documents named in them, never the whole corpus.

PAIRS = "pairs.parquet"


EXACT_PART_KIND, BAND_PART_KIND = "dedup-exact-part", "dedup-band-part"


PAIRS_SCHEMA = pa.schema([("key", pa.int64()), ("duplicate_of", pa.int64())])


BLOCK_ROWS = 65_536  # signature rows read at a time from a shard file


class NpyRows:
    """Rows of a 2-D (or 1-D) ``.npy`` file read on demand with ``pread``.

    Not a memory map on purpose: mapped pages a step has read stay in its resident set, so a step that scans
    a shard would hold the whole file; read rows are ordinary buffers that go when dropped.
    """

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(fh)
            self.offset = fh.tell()
        if fortran:
            raise InputDataError(f"{path}: Fortran-ordered array; expected one written by lmforge")
        self.path, self.dtype, self.shape = path, dtype, shape
        self.row_shape = shape[1:]
        self.row_bytes = dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))
        self._fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return self.shape[0]

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` (clipped to the file)."""
        stop = min(stop, len(self))
        count = max(0, stop - start)
        data = os.pread(self._fd, count * self.row_bytes, self.offset + start * self.row_bytes)
        return np.frombuffer(data, dtype=self.dtype).reshape(count, *self.row_shape)

    def close(self) -> None:
        os.close(self._fd)


def signature_files(shard_dir: str | Path) -> dict[str, NpyRows]:
    """One shard's signature arrays, opened for reading rows on demand (checksums verified once)."""
    manifest = read_manifest(shard_dir, verify=True)
    if manifest.get("kind") != SHARD_KIND:
        raise InputDataError(f"{shard_dir}: artifact kind {manifest.get('kind')!r}, expected {SHARD_KIND!r}")
    return {name: NpyRows(Path(shard_dir, file)) for name, file in SIGNATURES.items()}


def close_files(files: dict[str, NpyRows]) -> None:
    """Close a shard's signature files opened by :func:`signature_files`."""
    for rows in files.values():
        rows.close()


ROW_BITS = 40  # a band part locates a document as shard << 40 | row


def signature_at(files: list[dict[str, NpyRows]], where: int) -> np.ndarray:
    """The MinHash signature at ``shard << ROW_BITS | row``."""
    return files[where >> ROW_BITS]["minhash"].rows(where & ((1 << ROW_BITS) - 1), (where & ((1 << ROW_BITS) - 1)) + 1)[
        0
    ]


def part_of(values: np.ndarray, parts: int) -> np.ndarray:
    """Which of ``parts`` parts each uint64 value falls in (the values are well-mixed hashes)."""
    return (values % np.uint64(parts)).astype(np.int64)


def band_ranges(bands: int, groups: int) -> list[tuple[int, int]]:
    """``groups`` contiguous ``[first, last)`` ranges covering ``bands`` LSH bands as evenly as possible.

    More groups than bands give one band per group.
    """
    groups = max(1, min(groups, bands))
    edges = [round(i * bands / groups) for i in range(groups + 1)]
    return list(itertools.pairwise(edges))


def at_least_one(**counts: int) -> None:
    """Raise :class:`~lmforge.errors.ConfigError` naming the first of ``counts`` that is below 1."""
    for name, count in counts.items():
        if count < 1:
            raise ConfigError(f"{name}: must be at least 1, got {count}")


def write_pairs(
    kind: str, pairs: list[tuple[int, int]], cfg: CleanConfig, extra: dict[str, Any], output_dir: str | Path
) -> StageResult:
    """Write a ``kind`` artifact of ``(key, duplicate_of)`` pairs (sorted) with ``extra`` in its manifest."""
    pairs.sort()
    table = pa.table({"key": [a for a, _ in pairs], "duplicate_of": [b for _, b in pairs]}, schema=PAIRS_SCHEMA)
    metrics = {"pairs": float(len(pairs))}
    with staged_output(output_dir) as stage:
        pq.write_table(table, stage / PAIRS, compression="zstd")
        write_manifest(stage, kind, inputs={}, config=cfg.model_dump(), metrics=metrics, extra=extra)
    return StageResult(metrics=metrics, summary={"output": str(output_dir)})


def read_parts(part_dirs: Sequence[str | Path], kind: str, bands: int) -> np.ndarray:
    """The ``(key, duplicate_of)`` pairs of a whole fan-out, checked to be complete: every part of every group.

    Raises:
        InputDataError: an artifact of another kind, or a part missing, repeated or of another split.
    """
    found: dict[tuple[int, int, int], np.ndarray] = {}
    splits = set()
    for part_dir in part_dirs:
        manifest = read_manifest(part_dir, verify=True)
        if manifest.get("kind") != kind:
            raise InputDataError(f"{part_dir}: artifact kind {manifest.get('kind')!r}, expected {kind!r}")
        if "part" not in manifest:
            raise InputDataError(f"{part_dir}: manifest.json names no part; was it written by this lmforge?")
        (part, parts), (lo, hi) = manifest["part"], manifest.get("bands", (0, bands))
        if (lo, hi, part) in found:
            raise InputDataError(f"{part_dir}: {kind} bands [{lo}, {hi}) part {part} given twice")
        splits.add(parts)
        table = pq.read_table(Path(part_dir, PAIRS))
        found[lo, hi, part] = np.stack([table["key"].to_numpy(), table["duplicate_of"].to_numpy()], axis=1)
    ranges = sorted({(lo, hi) for lo, hi, _ in found})
    parts = splits.pop() if len(splits) == 1 else 0
    complete = set(found) == {(lo, hi, p) for lo, hi in ranges for p in range(parts)}
    edges = [0, *(hi for _, hi in ranges)]
    tiled = [lo for lo, _ in ranges] == edges[:-1] and edges[-1] == bands
    if not (found and complete and tiled):
        given = ", ".join(f"bands [{lo}, {hi}) part {p}" for lo, hi, p in sorted(found)) or "none"
        raise InputDataError(f"dedup: the {kind} artifacts do not cover every part of every band (given: {given})")
    return np.concatenate(list(found.values())).reshape(-1, 2)
