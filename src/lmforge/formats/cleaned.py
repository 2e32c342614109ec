"""The cleaned corpus: what ``clean`` / ``merge_shards`` write and ``tokenize`` and ``evaluate`` read; and the
cleaned shard: what ``clean_shard`` writes and ``merge_shards`` and the dedup steps read.

A cleaned corpus is a directory of Parquet shards ``part-*.parquet`` with the columns ``id``, ``text``,
``source``, ``lang``, a ``stats.json`` (documents and bytes in and out, removals per rule), a quarantine sample,
the malformed records and the manifest. A cleaned shard has the same files, its rows also carry their corpus
position ``key``, and it adds its documents' dedup signatures (:mod:`lmforge.formats.dedup`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from lmforge.artifacts import read_manifest
from lmforge.errors import InputDataError

KIND = "cleaned-corpus"

STATS = "stats.json"

SHARD_GLOB = "part-*.parquet"

SCHEMA = pa.schema([("id", pa.string()), ("text", pa.string()), ("source", pa.string()), ("lang", pa.string())])

SHARD_KIND = "cleaned-shard"
QUARANTINE = "quarantine.jsonl"
BAD_RECORDS = "bad_records.jsonl"  # every malformed input record with file:line and the problem
REPORT = "report.html"
# A cleaned shard also carries each document's corpus position, the merge and dedup key.
SHARD_SCHEMA = SCHEMA.append(pa.field("key", pa.int64()))
_ROW_GROUP_DOCS = 1000
_ROW_GROUP_BYTES = 16 << 20


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


class ParquetShards:
    """Write rows into ``part-NNNNN.parquet`` files of at most ``shard_docs`` rows each."""

    def __init__(self, root: Path, shard_docs: int, schema: pa.Schema = SCHEMA) -> None:
        self.root = root
        self.shard_docs = shard_docs
        self.schema = schema
        self.shards: list[dict[str, Any]] = []
        self._writer: pq.ParquetWriter | None = None
        self._rows: dict[str, list[Any]] = {name: [] for name in schema.names}
        self._buffered_bytes = 0

    def add(self, row: dict[str, Any]) -> None:
        if self._writer is None or self.shards[-1]["docs"] == self.shard_docs:
            self._roll()
        for name in self.schema.names:
            self._rows[name].append(row[name])
        self.shards[-1]["docs"] += 1
        self._buffered_bytes += len(row["text"])
        if len(self._rows["id"]) >= _ROW_GROUP_DOCS or self._buffered_bytes >= _ROW_GROUP_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self._writer is not None and self._rows["id"]:
            self._writer.write_table(pa.table(self._rows, schema=self.schema))
        self._rows = {name: [] for name in self.schema.names}
        self._buffered_bytes = 0

    def _roll(self) -> None:
        self.close()
        name = f"part-{len(self.shards):05d}.parquet"
        self.shards.append({"name": name, "docs": 0})
        self._writer = pq.ParquetWriter(self.root / name, self.schema, compression="zstd")

    def close(self) -> None:
        self._flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def shard_rows(shard_dir: Path) -> Iterator[dict[str, Any]]:
    """The rows of a ``cleaned-shard`` artifact (checksums verified), in its Parquet files' order."""
    manifest = read_manifest(shard_dir, verify=True)
    if manifest.get("kind") != SHARD_KIND:
        raise InputDataError(f"{shard_dir}: artifact kind {manifest.get('kind')!r}, expected {SHARD_KIND!r}")
    for name in sorted(n for n in manifest.get("files", {}) if Path(n).match(SHARD_GLOB)):
        for batch in pq.ParquetFile(Path(shard_dir, name)).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
