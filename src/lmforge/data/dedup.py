"""Global deduplication over compact per-shard signatures: exact (normalized-text hash) and MinHash LSH.

Fan-out design (the pipeline's ``clean`` step runs once per input shard, this step once):

1. :func:`lmforge.data.clean.clean_shard` writes each shard's surviving documents and, per document,
   its global corpus position ``key``, its exact digest and its MinHash signature (:data:`SIGNATURES`).
2. :func:`run` loads the signatures of every shard (about 430 bytes per document at 20 x 5), removes
   exact duplicates, clusters the rest by LSH band collisions (union-find) and keeps, in every cluster,
   the document with the smallest ``key``, i.e. the first in corpus order. It writes the removed keys.
3. :func:`lmforge.data.clean.finalize` drops the removed keys while merging the shards in key order.

Because ``key`` does not depend on how the corpus was split, 1 shard and N shards give the same output.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lmforge.artifacts import read_manifest, staged_output, write_manifest
from lmforge.config import CleanConfig
from lmforge.errors import InputDataError
from lmforge.results import StageResult

log = logging.getLogger("lmforge.dedup")

KIND = "dedup-plan"
SIGNATURES = {"keys": "sig-keys.npy", "exact": "sig-exact.npy", "minhash": "sig-minhash.npy"}
REMOVED = "removed.parquet"
EXACT_RULE, NEAR_RULE = "exact_dedup", "near_dedup"
REMOVED_SCHEMA = pa.schema([("key", pa.int64()), ("rule", pa.string()), ("duplicate_of", pa.int64())])


def exact_digest(text: str) -> bytes:
    """16-byte digest of casefolded text with every whitespace run collapsed to one space."""
    canonical = " ".join(text.casefold().split())
    return hashlib.blake2b(canonical.encode("utf-8"), digest_size=16).digest()


def save_signatures(root: Path, keys: list[int], exact: list[bytes], minhash: list[np.ndarray], perms: int) -> None:
    """Write one shard's signature arrays (``.npy``: no pickle, memory-mappable)."""
    np.save(root / SIGNATURES["keys"], np.asarray(keys, dtype=np.int64))
    np.save(root / SIGNATURES["exact"], np.frombuffer(b"".join(exact), dtype=np.uint8).reshape(-1, 16))
    sig = np.stack(minhash) if minhash else np.empty((0, perms), dtype=np.uint32)
    np.save(root / SIGNATURES["minhash"], sig)


def load_signatures(shard_dir: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(keys, exact digests, minhash signatures)`` of one cleaned shard (checksums verified)."""
    manifest = read_manifest(shard_dir, verify=True)
    if manifest.get("kind") != "cleaned-shard":
        raise InputDataError(f"{shard_dir}: artifact kind {manifest.get('kind')!r}, expected 'cleaned-shard'")
    arrays = [np.load(Path(shard_dir, SIGNATURES[name]), allow_pickle=False) for name in ("keys", "exact", "minhash")]
    return arrays[0], arrays[1], arrays[2]


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


def plan(cfg: CleanConfig, keys: np.ndarray, exact: np.ndarray, minhash: np.ndarray) -> dict[int, tuple[str, int]]:
    """``{removed key: (rule, key of the kept document)}`` over all documents of all shards."""
    from lmforge.data.minhash import MinHasher

    if not (keys[:-1] <= keys[1:]).all():  # shards come in corpus order; copying the arrays is rarely needed
        order = np.argsort(keys, kind="stable")
        keys, exact, minhash = keys[order], exact[order], minhash[order]
    removed: dict[int, tuple[str, int]] = {}
    alive = np.ones(len(keys), dtype=bool)
    if cfg.exact_dedup and len(keys):
        first: dict[bytes, int] = {}
        raw = exact.tobytes()
        for i, digest in enumerate(raw[j : j + 16] for j in range(0, len(raw), 16)):
            kept = first.setdefault(digest, i)
            if kept != i:
                removed[int(keys[i])] = (EXACT_RULE, int(keys[kept]))
                alive[i] = False
    near = cfg.near_dedup
    if near.enabled and alive.sum() > 1:
        idx = np.flatnonzero(alive)
        bands = MinHasher(near).band_keys(minhash if len(idx) == len(minhash) else minhash[idx])
        clusters = _Clusters(keys[idx])
        for b in range(bands.shape[1]):
            column = bands[:, b]
            by_value = np.argsort(column, kind="stable")
            values = column[by_value]
            starts = np.flatnonzero(np.concatenate(([True], values[1:] != values[:-1])))
            ends = np.append(starts[1:], len(values))
            for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
                if e - s < 2:
                    continue
                members = by_value[s:e].tolist()
                head = members[0]
                for other in members[1:]:
                    if near.min_similarity > 0:
                        agree = float(np.mean(minhash[idx[head]] == minhash[idx[other]]))
                        if agree < near.min_similarity:
                            continue
                    clusters.union(head, other)
        for local in range(len(idx)):
            root = clusters.find(local)
            if root != local:
                removed[int(keys[idx[local]])] = (NEAR_RULE, int(keys[idx[root]]))
    return removed


def run(cfg: CleanConfig, shard_dirs: list[str | Path], output_dir: str | Path) -> StageResult:
    """The global dedup step: read every shard's signatures, write the keys to remove to ``output_dir``."""
    if not shard_dirs:
        raise InputDataError("dedup: no cleaned shards given")
    loaded = [load_signatures(d) for d in shard_dirs]
    keys = np.concatenate([k for k, _, _ in loaded])
    if len(np.unique(keys)) != len(keys):
        raise InputDataError("dedup: the shards overlap (a document key occurs twice); were they split correctly?")
    exact = np.concatenate([e for _, e, _ in loaded])
    perms = cfg.near_dedup.bands * cfg.near_dedup.rows
    minhash = np.concatenate([m for _, _, m in loaded]) if len(keys) else np.empty((0, perms), np.uint32)
    del loaded  # the per-shard arrays are copied above; free them before planning
    removed = plan(cfg, keys, exact, minhash)
    clusters: dict[str, set[int]] = defaultdict(set)
    for rule, kept in removed.values():
        clusters[rule].add(kept)
    metrics: dict[str, float] = {
        "docs": len(keys),
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
        inputs = {f"shard_{i:05d}": str(d) for i, d in enumerate(shard_dirs)}
        write_manifest(stage, KIND, inputs=inputs, config=cfg.model_dump(), metrics=metrics)
    log.debug(
        "dedup over %d shards: %d documents, %d exact and %d near duplicates removed",
        len(shard_dirs),
        metrics["docs"],
        metrics["removed_exact_dedup"],
        metrics["removed_near_dedup"],
    )
    return StageResult(metrics=metrics, summary={"output": str(output_dir)})


def read_removed(dedup_dir: str | Path) -> dict[int, tuple[str, int]]:
    """``{key: (rule, duplicate_of)}`` from a dedup plan directory (checksums verified)."""
    manifest = read_manifest(dedup_dir, verify=True)
    if manifest.get("kind") != KIND:
        raise InputDataError(f"{dedup_dir}: artifact kind {manifest.get('kind')!r}, expected {KIND!r}")
    table = pq.read_table(Path(dedup_dir, REMOVED)).to_pydict()
    return {k: (r, d) for k, r, d in zip(table["key"], table["rule"], table["duplicate_of"], strict=True)}
