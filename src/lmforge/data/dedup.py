"""Global deduplication over compact per-shard signatures: exact (normalized-text hash) and MinHash LSH.

Fan-out design (the pipeline's ``clean`` step runs once per input shard, this step once):

1. :func:`lmforge.data.clean.clean_shard` writes each shard's surviving documents and, per document,
   its global corpus position ``key``, its exact digest and its MinHash signature (:data:`SIGNATURES`).
2. :func:`run` loads the signatures of every shard (about 430 bytes per document at 20 x 5), removes
   exact duplicates, clusters the rest by LSH band collisions (union-find) and keeps, in every cluster,
   the document with the smallest ``key``, i.e. the first in corpus order. It writes the removed keys.
3. :func:`lmforge.data.clean.finalize` drops the removed keys while merging the shards in key order.

Because ``key`` does not depend on how the corpus was split, 1 shard and N shards give the same output.

Past one pod's memory, the DAG runs step 2 as a fan-out of its own (``plan_dedup``, ``dedup_exact_part``,
``dedup_band_part``, ``dedup_union``: :func:`plan_parts`, :func:`exact_part`, :func:`band_part`,
:func:`union`), whose steps each hold one part of the signatures and which writes the same plan as :func:`run`.
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
from lmforge.config import CleanConfig, NearDedupConfig
from lmforge.data.signatures import (
    EXACT_RULE,
    KIND,
    NEAR_RULE,
    REMOVED,
    REMOVED_SCHEMA,
    SIGNATURES,
    load_signatures,
)
from lmforge.errors import ConfigError, InputDataError
from lmforge.results import StageResult

log = logging.getLogger("lmforge.dedup")


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
        return near.min_similarity <= 0 or _agreement(minhash[idx[i]], minhash[idx[j]]) >= near.min_similarity

    for b in range(bands.shape[1]):
        column = bands[:, b]
        by_value = np.argsort(column, kind="stable")
        for s, e in _buckets(column[by_value]):
            head, *others = by_value[s:e].tolist()
            for other in others:
                if similar(head, other):
                    clusters.union(head, other)
    for local in range(len(idx)):
        root = clusters.find(local)
        if root != local:
            removed[int(keys[idx[local]])] = (NEAR_RULE, int(keys[idx[root]]))


def _buckets(values: np.ndarray) -> Iterator[tuple[int, int]]:
    """``[start, end)`` of every run of two or more equal values in the sorted ``values`` (an LSH bucket)."""
    if not len(values):
        return
    starts = np.flatnonzero(np.concatenate(([True], values[1:] != values[:-1])))
    ends = np.append(starts[1:], len(values))
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        if e - s >= 2:
            yield s, e


def _agreement(signature: np.ndarray, other: np.ndarray) -> float:
    """The share of MinHash positions on which two signatures agree (an estimate of their Jaccard similarity)."""
    return float(np.mean(signature == other))


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
    return _write_plan(cfg, removed, len(keys), {f"shard_{i:05d}": str(d) for i, d in enumerate(shards)}, plan)


def _write_plan(
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
# union               (union-find over the pairs only)    -> the same ``dedup-plan`` as :func:`run`
#
# Each step reads every shard's signature files a block of rows at a time (pread, not a memory map) and holds
# only the rows of its part: an exact part ~24 bytes per document of its part plus a dict entry, a band part
# ~(24 + 24) bytes per document and band of its group (entry and sort copy).
# The union step holds the pairs and the documents named in them, never the whole corpus.

PAIRS = "pairs.parquet"
EXACT_PART_KIND, BAND_PART_KIND = "dedup-exact-part", "dedup-band-part"
PAIRS_SCHEMA = pa.schema([("key", pa.int64()), ("duplicate_of", pa.int64())])
_BLOCK_ROWS = 65_536  # signature rows read at a time from a shard file


class _NpyRows:
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


def _signature_files(shard_dir: str | Path) -> dict[str, _NpyRows]:
    """One shard's signature arrays, opened for reading rows on demand (checksums verified once)."""
    manifest = read_manifest(shard_dir, verify=True)
    if manifest.get("kind") != "cleaned-shard":
        raise InputDataError(f"{shard_dir}: artifact kind {manifest.get('kind')!r}, expected 'cleaned-shard'")
    return {name: _NpyRows(Path(shard_dir, file)) for name, file in SIGNATURES.items()}


def _close(files: dict[str, _NpyRows]) -> None:
    for rows in files.values():
        rows.close()


_ROW_BITS = 40  # a band part locates a document as shard << 40 | row


def _row(files: list[dict[str, _NpyRows]], where: int) -> np.ndarray:
    """The MinHash signature at ``shard << _ROW_BITS | row``."""
    return files[where >> _ROW_BITS]["minhash"].rows(
        where & ((1 << _ROW_BITS) - 1), (where & ((1 << _ROW_BITS) - 1)) + 1
    )[0]


def _part_of(values: np.ndarray, parts: int) -> np.ndarray:
    """Which of ``parts`` parts each uint64 value falls in (the values are well-mixed hashes)."""
    return (values % np.uint64(parts)).astype(np.int64)


def band_ranges(bands: int, groups: int) -> list[tuple[int, int]]:
    """``groups`` contiguous ``[first, last)`` ranges covering ``bands`` LSH bands as evenly as possible.

    More groups than bands give one band per group.
    """
    groups = max(1, min(groups, bands))
    edges = [round(i * bands / groups) for i in range(groups + 1)]
    return list(itertools.pairwise(edges))


def _at_least_one(**counts: int) -> None:
    for name, count in counts.items():
        if count < 1:
            raise ConfigError(f"{name}: must be at least 1, got {count}")


def plan_parts(cfg: CleanConfig, *, band_groups: int, parts: int) -> StageResult:
    """The ``plan_dedup`` stage: the task indices of the exact and the band fan-out.

    Exact part ``p`` owns the documents whose digest hashes to ``p`` of ``parts``; band task ``t`` is band
    group ``t // parts`` (of ``band_groups``, at most one per LSH band) and part ``t % parts`` of its bucket
    keys. Only integers, so that the KFP backend's drivers accept every loop item.

    Raises:
        ConfigError: ``band_groups`` or ``parts`` is below 1.
    """
    _at_least_one(band_groups=band_groups, parts=parts)
    groups = len(band_ranges(cfg.near_dedup.bands, band_groups))
    metrics = {"exact_parts": float(parts), "band_groups": float(groups), "band_tasks": float(groups * parts)}
    summary = {"exact_parts": list(range(parts)), "band_tasks": list(range(groups * parts))}
    return StageResult(metrics=metrics, summary=summary)


def _write_pairs(
    kind: str, pairs: list[tuple[int, int]], cfg: CleanConfig, extra: dict[str, Any], output_dir: str | Path
) -> StageResult:
    pairs.sort()
    table = pa.table({"key": [a for a, _ in pairs], "duplicate_of": [b for _, b in pairs]}, schema=PAIRS_SCHEMA)
    metrics = {"pairs": float(len(pairs))}
    with staged_output(output_dir) as stage:
        pq.write_table(table, stage / PAIRS, compression="zstd")
        write_manifest(stage, kind, inputs={}, config=cfg.model_dump(), metrics=metrics, extra=extra)
    return StageResult(metrics=metrics, summary={"output": str(output_dir)})


def _read_parts(part_dirs: Sequence[str | Path], kind: str, bands: int) -> np.ndarray:
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


def exact_part(
    cfg: CleanConfig, *, shards: Sequence[str | Path], part: int, parts: int, exact: str | Path
) -> StageResult:
    """The ``dedup_exact_part`` stage: exact duplicates among the documents whose digest falls in ``part``.

    As in :func:`run`, the document with the smallest key keeps its text; every other copy is written to
    ``exact`` as a ``(key, duplicate_of)`` pair.

    Raises:
        ConfigError: ``part`` is not one of ``0 .. parts-1``.
    """
    _at_least_one(parts=parts)
    if not 0 <= part < parts:
        raise ConfigError(f"part: must be in 0 .. {parts - 1} (parts={parts}), got {part}")
    found_keys, found_digests = [], []
    if cfg.exact_dedup:
        for shard_dir in shards:
            files = _signature_files(shard_dir)
            for start in range(0, len(files["keys"]), _BLOCK_ROWS):
                digests = files["exact"].rows(start, start + _BLOCK_ROWS)
                mine = _part_of(digests[:, :8].copy().view(np.uint64).ravel(), parts) == part
                found_keys.append(files["keys"].rows(start, start + _BLOCK_ROWS)[mine])
                found_digests.append(digests[mine])
            _close(files)
    pairs: list[tuple[int, int]] = []
    if found_keys:
        keys, digests = np.concatenate(found_keys), np.concatenate(found_digests)
        order = np.argsort(keys, kind="stable")
        first: dict[bytes, int] = {}
        for key, digest in zip(keys[order].tolist(), digests[order], strict=True):
            kept = first.setdefault(digest.tobytes(), key)
            if kept != key:
                pairs.append((key, kept))
    return _write_pairs(EXACT_PART_KIND, pairs, cfg, {"part": [part, parts]}, exact)


def band_part(
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

    Band task ``band_task`` (from :func:`plan_parts`) is LSH band group ``band_task // parts`` of
    ``band_groups`` and bucket-key part ``band_task % parts``. The documents the ``exact`` parts remove are
    left out, as :func:`run` does. In every bucket (documents sharing a band key) the one with the smallest
    key is the head, and each other member whose signature agrees with the head's on at least
    ``near_dedup.min_similarity`` of the positions pairs with it.

    Raises:
        ConfigError: ``band_task`` is outside the plan of ``band_groups`` × ``parts`` tasks.
        InputDataError: the ``exact`` parts are not one complete exact fan-out.
    """
    near = cfg.near_dedup
    _at_least_one(band_groups=band_groups, parts=parts)
    ranges = band_ranges(near.bands, band_groups)
    if not 0 <= band_task < len(ranges) * parts:
        raise ConfigError(
            f"band_task: must be in 0 .. {len(ranges) * parts - 1} ({len(ranges)} band groups × {parts} parts), "
            f"got {band_task}"
        )
    group, part = divmod(band_task, parts)
    lo, hi = ranges[group]
    found_pairs: list[tuple[int, int]] = []
    removed = {int(k) for k in _read_parts(exact, EXACT_PART_KIND, near.bands)[:, 0]}
    if near.enabled:
        files = [_signature_files(d) for d in shards]
        for blocks in _band_entries(files, near, removed, (lo, hi), part, parts):
            table = np.concatenate(blocks) if blocks else np.empty((0, 3), np.int64)
            blocks.clear()
            found_pairs += _confirmed_pairs(table, files, near.min_similarity)
        for shard_files in files:
            _close(shard_files)
    extra = {"bands": [lo, hi], "part": [part, parts]}
    return _write_pairs(BAND_PART_KIND, found_pairs, cfg, extra, pairs)


def _band_entries(
    files: list[dict[str, _NpyRows]],
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
        for start in range(0, len(sig["keys"]), _BLOCK_ROWS):
            keys = sig["keys"].rows(start, start + _BLOCK_ROWS)
            alive = np.fromiter((k not in removed for k in keys.tolist()), bool, len(keys))
            columns = sig["minhash"].rows(start, start + _BLOCK_ROWS)[:, lo * near.rows : hi * near.rows]
            band_keys = hasher.band_keys(columns)
            where = (shard << _ROW_BITS) + np.arange(start, start + len(keys), dtype=np.int64)
            for b in range(hi - lo):
                mine = alive & (_part_of(band_keys[:, b], parts) == part)
                found[b].append(np.stack([band_keys[mine, b].view(np.int64), keys[mine], where[mine]], axis=1))
    return found


def _confirmed_pairs(
    table: np.ndarray, files: list[dict[str, _NpyRows]], min_similarity: float
) -> list[tuple[int, int]]:
    """``(key, head's key)`` of every member of a bucket of one band's ``table`` (rows of :func:`_band_entries`)
    but its head (the smallest key), when its signature agrees with the head's on ``min_similarity`` of it."""
    table = table[np.lexsort((table[:, 1], table[:, 0]))]  # by band key, then document key
    pairs: list[tuple[int, int]] = []
    for s, e in _buckets(table[:, 0]):
        head = table[s]
        head_sig = _row(files, int(head[2])) if min_similarity > 0 else None
        for other in table[s + 1 : e]:
            if head_sig is not None and _agreement(head_sig, _row(files, int(other[2]))) < min_similarity:
                continue
            pairs.append((int(other[1]), int(head[1])))
    return pairs


def union(
    cfg: CleanConfig,
    *,
    shards: Sequence[str | Path],
    exact: Sequence[str | Path],
    pairs: Sequence[str | Path],
    plan: str | Path,
) -> StageResult:
    """The ``dedup_union`` stage: join the parts' pairs into the ``dedup-plan`` of :func:`run`.

    Union-find over the documents named in pairs only; a near-duplicate cluster keeps its smallest key, as
    :func:`run` does. ``shards`` are read only for the document count.

    Raises:
        InputDataError: the ``exact`` or the band ``pairs`` artifacts are not one complete fan-out each.
    """
    bands = cfg.near_dedup.bands
    removed: dict[int, tuple[str, int]] = {}
    for key, kept in _read_parts(exact, EXACT_PART_KIND, bands).tolist():
        removed[key] = (EXACT_RULE, kept)
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        root = x
        while parent.get(root, root) != root:
            root = parent[root]
        while parent.get(x, x) != root:
            parent[x], x = root, parent[x]
        return root

    for other, head in _read_parts(pairs, BAND_PART_KIND, bands).tolist():
        a, b = find(other), find(head)
        if a != b:
            parent[max(a, b)] = min(a, b)
    for key in list(parent):
        root = find(key)
        if root != key:
            removed[key] = (NEAR_RULE, root)
    docs = sum(len(np.load(Path(d, SIGNATURES["keys"]), mmap_mode="r")) for d in shards)
    inputs = {f"part_{i:05d}": str(d) for i, d in enumerate([*exact, *pairs])}
    return _write_plan(cfg, removed, docs, inputs, plan)


def run_partitioned(
    cfg: CleanConfig, shard_dirs: list[str | Path], output_dir: str | Path, *, groups: int = 4, parts: int = 1
) -> StageResult:
    """:func:`run` as the DAG's fan-out does it (plan, exact parts, band tasks, union), in this process."""
    planned = plan_parts(cfg, band_groups=groups, parts=parts).summary
    scratch = Path(output_dir).with_name(Path(output_dir).name + ".parts")
    exact_dirs = [scratch / f"exact-{p}" for p in planned["exact_parts"]]
    for p, exact_dir in zip(planned["exact_parts"], exact_dirs, strict=True):
        exact_part(cfg, shards=shard_dirs, part=p, parts=parts, exact=exact_dir)
    band_dirs = [scratch / f"bands-{t}" for t in planned["band_tasks"]]
    for t, band_dir in zip(planned["band_tasks"], band_dirs, strict=True):
        band_part(
            cfg, shards=shard_dirs, exact=exact_dirs, band_task=t, band_groups=groups, parts=parts, pairs=band_dir
        )
    return union(cfg, shards=shard_dirs, exact=exact_dirs, pairs=band_dirs, plan=output_dir)
