"""The ``clean`` stage: normalize raw documents, drop short ones and exact duplicates.

Each document is normalized (:class:`Normalize`), then passes the filters in order; the first filter
that rejects it counts the removal and gives the reason. Survivors go to Parquet shards
``part-NNNNN.parquet`` (columns ``id``, ``text``, ``source``, ``lang``); a sample of the rejected
documents per rule goes to ``quarantine.jsonl`` for review.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from lmforge import report_html
from lmforge.artifacts import read_manifest, staged_output, write_manifest
from lmforge.config import CleanConfig
from lmforge.data.corpus import CorpusReader, Document
from lmforge.errors import InputDataError
from lmforge.results import StageResult

log = logging.getLogger("lmforge.clean")

KIND = "cleaned-corpus"
QUARANTINE = "quarantine.jsonl"
STATS = "stats.json"
REPORT = "report.html"
SHARD_GLOB = "part-*.parquet"
UNDETERMINED_LANG = "und"  # ISO 639-2 "undetermined" until language identification exists
SCHEMA = pa.schema([("id", pa.string()), ("text", pa.string()), ("source", pa.string()), ("lang", pa.string())])
QUARANTINE_TEXT_CHARS = 2000
_ROW_GROUP_DOCS = 1000
_ROW_GROUP_BYTES = 16 << 20

# C0/C1 controls except tab and newline, and the byte order mark that editors leave at the start of files
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ufeff]")
# A run of whitespace without a newline that is not already a single space; matching lone spaces too
# makes ``sub`` several times slower on ordinary prose.
_HSPACE = re.compile(r"[^\S\n]{2,}|[^\S\n ]")


class Normalize:
    """Unicode normalization, line endings to ``\\n``, control characters dropped, spaces collapsed.

    Newlines are kept (they carry structure such as verse and paragraphs); a run of spaces and tabs
    becomes one space, and spaces next to a newline and at either end of the text are removed.
    """

    def __init__(self, form: str) -> None:
        self.form = form
        self.changed = 0

    def __call__(self, text: str) -> str:
        out = unicodedata.normalize(self.form, text)
        out = out.replace("\r\n", "\n").replace("\r", "\n")
        out = _CONTROL.sub("", out)
        out = _HSPACE.sub(" ", out)
        out = out.replace(" \n", "\n").replace("\n ", "\n").strip()
        if out != text:
            self.changed += 1
        return out


class Filter:
    """One cleaning rule: :meth:`check` returns ``None`` to keep a document, else the reason."""

    name: ClassVar[str]

    def __init__(self) -> None:
        self.removed = 0

    def check(self, text: str) -> str | None:
        raise NotImplementedError

    def __call__(self, text: str) -> str | None:
        reason = self.check(text)
        if reason is not None:
            self.removed += 1
        return reason


class NonEmpty(Filter):
    """Drop documents that are empty after normalization."""

    name = "empty"

    def check(self, text: str) -> str | None:
        return None if text else "empty after normalization"


class MinChars(Filter):
    """Drop documents shorter than ``min_chars`` characters."""

    name = "min_chars"

    def __init__(self, min_chars: int) -> None:
        super().__init__()
        self.min_chars = min_chars

    def check(self, text: str) -> str | None:
        return None if len(text) >= self.min_chars else f"{len(text)} chars < {self.min_chars}"


class MinWords(Filter):
    """Drop documents with fewer than ``min_words`` whitespace-separated words."""

    name = "min_words"

    def __init__(self, min_words: int) -> None:
        super().__init__()
        self.min_words = min_words

    def check(self, text: str) -> str | None:
        words = len(text.split())
        return None if words >= self.min_words else f"{words} words < {self.min_words}"


def dedup_key(text: str) -> bytes:
    """Digest of casefolded text with every whitespace run collapsed to one space."""
    canonical = " ".join(text.casefold().split())
    return hashlib.blake2b(canonical.encode("utf-8"), digest_size=16).digest()


class ExactDedup(Filter):
    """Drop a document whose :func:`dedup_key` was already seen (the first copy is kept).

    Holds one 16-byte digest per kept document in memory; corpora beyond a few hundred million
    documents need the sharded global dedup step instead.
    """

    name = "exact_dedup"

    def __init__(self, enabled: bool = True) -> None:
        super().__init__()
        self.enabled = enabled
        self._seen: set[bytes] = set()

    def check(self, text: str) -> str | None:
        if not self.enabled:
            return None
        key = dedup_key(text)
        if key in self._seen:
            return "exact duplicate of an earlier document"
        self._seen.add(key)
        return None


def build_filters(cfg: CleanConfig) -> list[Filter]:
    """The filters of ``cfg`` in the order they are applied (dedup last, so only survivors count)."""
    return [NonEmpty(), MinChars(cfg.min_chars), MinWords(cfg.min_words), ExactDedup(cfg.exact_dedup)]


class _ParquetShards:
    """Write rows into ``part-NNNNN.parquet`` files of at most ``shard_docs`` rows each."""

    def __init__(self, root: Path, shard_docs: int) -> None:
        self.root = root
        self.shard_docs = shard_docs
        self.shards: list[dict[str, Any]] = []
        self._writer: pq.ParquetWriter | None = None
        self._rows: dict[str, list[str]] = {name: [] for name in SCHEMA.names}
        self._buffered_bytes = 0

    def add(self, row: dict[str, str]) -> None:
        if self._writer is None or self.shards[-1]["docs"] == self.shard_docs:
            self._roll()
        for name in SCHEMA.names:
            self._rows[name].append(row[name])
        self.shards[-1]["docs"] += 1
        self._buffered_bytes += len(row["text"])
        if len(self._rows["id"]) >= _ROW_GROUP_DOCS or self._buffered_bytes >= _ROW_GROUP_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self._writer is not None and self._rows["id"]:
            self._writer.write_table(pa.table(self._rows, schema=SCHEMA))
        self._rows = {name: [] for name in SCHEMA.names}
        self._buffered_bytes = 0

    def _roll(self) -> None:
        self.close()
        name = f"part-{len(self.shards):05d}.parquet"
        self.shards.append({"name": name, "docs": 0})
        self._writer = pq.ParquetWriter(self.root / name, SCHEMA, compression="zstd")

    def close(self) -> None:
        self._flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def run(cfg: CleanConfig, input_uri: str, output_dir: str | Path) -> StageResult:
    """Clean the corpus at ``input_uri`` into ``output_dir`` (committed only on success).

    Raises:
        InputDataError: the corpus is missing, has too many malformed records, has no documents, or
            no document survives cleaning.
    """
    normalize = Normalize(cfg.unicode_form)
    filters = build_filters(cfg)
    reader = CorpusReader(input_uri, text_field=cfg.text_field, max_bad_records=cfg.max_bad_records)
    docs_in = docs_out = bytes_in = bytes_out = 0
    quarantined = dict.fromkeys([f.name for f in filters], 0)
    start = time.perf_counter()

    with staged_output(output_dir) as stage:
        shards = _ParquetShards(stage, cfg.shard_docs)
        with open(stage / QUARANTINE, "w", encoding="utf-8") as quarantine:
            for doc in tqdm(reader, desc="clean", unit="doc", disable=None):
                docs_in += 1
                bytes_in += len(doc.text.encode("utf-8"))
                text = normalize(doc.text)
                rejected = next(((f.name, r) for f in filters if (r := f(text)) is not None), None)
                if rejected is None:
                    docs_out += 1
                    bytes_out += len(text.encode("utf-8"))
                    shards.add({"id": doc.id, "text": text, "source": doc.source, "lang": UNDETERMINED_LANG})
                elif quarantined[rejected[0]] < cfg.quarantine_samples:
                    quarantined[rejected[0]] += 1
                    _write_quarantine(quarantine, rejected[0], rejected[1], doc)
            for bad in reader.bad_samples[: cfg.quarantine_samples]:
                record = {"rule": "bad_record", "reason": bad.problem, "source": bad.source}
                quarantine.write(json.dumps(record, ensure_ascii=False) + "\n")
        shards.close()
        elapsed = time.perf_counter() - start

        removed = {f.name: f.removed for f in filters}
        if docs_in == 0:
            raise InputDataError(f"corpus {input_uri}: no documents ({reader.bad_records} bad records)")
        if docs_out == 0:
            counts = ", ".join(f"{name}: {n}" for name, n in removed.items() if n)
            raise InputDataError(f"corpus {input_uri}: all {docs_in} documents were removed by cleaning ({counts})")

        metrics: dict[str, float] = {
            "docs_in": docs_in,
            "docs_out": docs_out,
            "bytes_in": bytes_in,
            "bytes_out": bytes_out,
            **{f"removed_{name}": n for name, n in removed.items()},
            "bad_records": reader.bad_records,
            "docs_normalized": normalize.changed,
            "duplicate_rate": removed[ExactDedup.name] / docs_in,
            "docs_per_sec": docs_in / max(elapsed, 1e-9),
        }
        stats = {
            "input": input_uri,
            "files": reader.files,
            "metrics": metrics,
            "removed": removed,
            "shards": shards.shards,
            "quarantined": {
                **quarantined,
                "bad_record": min(len(reader.bad_samples), cfg.quarantine_samples),
            },
        }
        (stage / STATS).write_text(json.dumps(stats, indent=2), encoding="utf-8")
        html = _report(input_uri, metrics, removed)
        (stage / REPORT).write_text(html, encoding="utf-8")
        write_manifest(stage, KIND, inputs={"corpus": input_uri}, config=cfg.model_dump(), metrics=metrics)

    log.info(
        "cleaned %s: %d of %d documents kept (%s), %d bad records, %.0f docs/s",
        input_uri,
        docs_out,
        docs_in,
        ", ".join(f"{name} -{n}" for name, n in removed.items()),
        reader.bad_records,
        metrics["docs_per_sec"],
    )
    summary = {"output": str(output_dir), "shards": shards.shards, "files": reader.files}
    return StageResult(metrics=metrics, html=html, summary=summary)


def _write_quarantine(fh: Any, rule: str, reason: str, doc: Document) -> None:
    text = doc.text[:QUARANTINE_TEXT_CHARS]
    record = {
        "rule": rule,
        "reason": reason,
        "source": doc.source,
        "id": doc.id,
        "text": text,
        "truncated": len(doc.text) > len(text),
    }
    fh.write(json.dumps(record, ensure_ascii=False) + "\n")


def _report(input_uri: str, metrics: dict[str, float], removed: dict[str, int]) -> str:
    plot = report_html.bar_plot(
        {**removed, "bad_record": metrics["bad_records"]},
        title="Documents removed per rule",
        ylabel="documents",
    )
    rows = [(name, value) for name, value in metrics.items()]
    return report_html.page(
        "lmforge clean",
        [("Removals per rule", plot), ("Metrics", report_html.table(["metric", "value"], rows))],
        subtitle=f"input: {input_uri}",
    )


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
