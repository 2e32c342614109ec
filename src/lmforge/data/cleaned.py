"""The cleaned corpus: what ``clean`` / ``merge_shards`` write and ``tokenize`` and ``evaluate`` read.

A directory of Parquet shards ``part-*.parquet`` with the columns ``id``, ``text``, ``source``, ``lang``, a
``stats.json`` (documents and bytes in and out, removals per rule), a quarantine sample and the manifest.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lmforge.artifacts import read_manifest
from lmforge.errors import InputDataError

KIND = "cleaned-corpus"

STATS = "stats.json"

SHARD_GLOB = "part-*.parquet"

SCHEMA = pa.schema([("id", pa.string()), ("text", pa.string()), ("source", pa.string()), ("lang", pa.string())])


def read_cleaned(cleaned_dir: str | Path, *, verify: bool = True) -> Iterator[dict[str, str]]:
    """Stream the rows (``id``, ``text``, ``source``, ``lang``) of a ``clean`` output directory.

    Args:
        verify: check every file's sha256 against the manifest before reading.
    """
    manifest = read_manifest(cleaned_dir, verify=verify)
    if manifest.get("kind") != KIND:
        raise InputDataError(f"{cleaned_dir}: artifact kind {manifest.get('kind')!r}, expected {KIND!r}")
    names = sorted(n for n in manifest.get("files", {}) if Path(n).match(SHARD_GLOB))
    for name in names:
        for batch in pq.ParquetFile(Path(cleaned_dir, name)).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
