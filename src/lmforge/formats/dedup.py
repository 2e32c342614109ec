"""The files between the cleaning fan-out's steps: each shard's dedup signatures and the global removal plan.

``clean_shard`` writes its documents' signatures (``save_signatures``); ``dedup_shards`` reads every shard's
(``load_signatures``) and writes the removal plan; ``merge_shards`` reads the plan (``read_removed``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lmforge.artifacts import read_manifest
from lmforge.errors import InputDataError

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


def read_removed(dedup_dir: str | Path) -> dict[int, tuple[str, int]]:
    """``{key: (rule, duplicate_of)}`` from a dedup plan directory (checksums verified)."""
    manifest = read_manifest(dedup_dir, verify=True)
    if manifest.get("kind") != KIND:
        raise InputDataError(f"{dedup_dir}: artifact kind {manifest.get('kind')!r}, expected {KIND!r}")
    table = pq.read_table(Path(dedup_dir, REMOVED)).to_pydict()
    return {k: (r, d) for k, r, d in zip(table["key"], table["rule"], table["duplicate_of"], strict=True)}
