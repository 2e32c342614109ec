"""The ``clean_shard`` stage: clean one shard of the corpus and sign its documents for dedup.

Each document is normalized (:class:`~lmforge.data.cleaning.Normalize`), run through the rules of
:func:`~lmforge.data.cleaning.build_rules` (the first that rejects a document counts the removal and gives the
reason) and PII-redacted; the survivors are written with their dedup signatures.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from lmforge.artifacts import staged_output, write_manifest
from lmforge.config import CleanConfig
from lmforge.cpus import available_cpus
from lmforge.data.cleaning import Quarantine, add_counters, cleaned_chunks
from lmforge.data.corpus import CorpusReader, Document
from lmforge.formats.cleaned import BAD_RECORDS, QUARANTINE, SHARD_KIND, SHARD_SCHEMA, STATS, ParquetShards
from lmforge.formats.dedup import save_signatures
from lmforge.results import StageResult

log = logging.getLogger("lmforge.clean")


@dataclass
class _ShardTally:
    """What :func:`run` counts of its documents, and the keys and signatures of those it keeps."""

    docs_in: int = 0
    docs_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    keys: list[int] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)
    signatures: list[Any] = field(default_factory=list)

    def read(self, doc: Document) -> None:
        """Count a document of the input."""
        self.docs_in += 1
        self.bytes_in += len(doc.text.encode("utf-8"))

    def keep(self, doc: Document, text: str, lang: str, digest: bytes, signature: Any) -> dict[str, Any]:
        """Count a kept document (``text``: its cleaned text), note its dedup signature; its shard row."""
        self.docs_out += 1
        self.bytes_out += len(text.encode("utf-8"))
        self.keys.append(doc.key)
        self.digests.append(digest)
        self.signatures.append(signature)
        return {"id": doc.id, "text": text, "source": doc.source, "lang": lang, "key": doc.key}


def run(cfg: CleanConfig, *, corpus_uri: str, shard_index: int, shard_count: int, shard: str | Path) -> StageResult:
    """Clean shard ``shard_index`` of ``shard_count`` of the corpus: rules, PII, dedup signatures.

    Writes a ``cleaned-shard`` artifact: surviving documents (``part-*.parquet`` with their corpus
    ``key``), their signatures for ``dedup_shards``, the shard's quarantine sample and
    counters in ``stats.json``. A shard may be empty; ``merge_shards`` decides whether the corpus is.
    The documents are cleaned by ``cfg.workers`` processes (0: one per available CPU); the output is
    byte for byte the same for any number of them.
    """
    workers = cfg.workers or available_cpus()
    tally = _ShardTally()
    start = time.perf_counter()
    with staged_output(shard) as stage:
        reader, counters = _clean_into(stage, cfg, corpus_uri, (shard_index, shard_count), workers, tally)
        perms = cfg.near_dedup.bands * cfg.near_dedup.rows if cfg.near_dedup.enabled else 0
        save_signatures(stage, tally.keys, tally.digests, tally.signatures, perms)
        stats = {
            "input": corpus_uri,
            "shard": [shard_index, shard_count],
            "files": reader.files,
            "counts": _shard_counts(tally, reader.bad_records, counters),
            "removed": counters["removed"],
            "reasons": {name: dict(sorted(by.items())) for name, by in counters["reasons"].items() if by},
            "workers": workers,
            "seconds": time.perf_counter() - start,
        }
        (stage / STATS).write_text(json.dumps(stats, indent=2), encoding="utf-8")
        write_manifest(
            stage,
            SHARD_KIND,
            inputs={"corpus": corpus_uri},
            config=cfg.model_dump(),
            metrics=stats["counts"],
            extra={"shard": [shard_index, shard_count]},
        )
    log.debug(
        "cleaned shard %d/%d of %s: %d of %d documents kept",
        shard_index,
        shard_count,
        corpus_uri,
        tally.docs_out,
        tally.docs_in,
    )
    return StageResult(metrics={k: float(v) for k, v in stats["counts"].items()}, summary={"output": str(shard)})


def _clean_into(
    stage: Path, cfg: CleanConfig, corpus_uri: str, shard: tuple[int, int], workers: int, tally: _ShardTally
) -> tuple[CorpusReader, dict[str, Any]]:
    """Clean shard ``(index, count)`` of the corpus into ``stage``: the kept documents to Parquet shards, a sample
    of the rejected ones and of the malformed records to the quarantine, every malformed record to
    ``bad_records.jsonl``.

    Returns the reader (its files and bad-record count) and the cleaning counters.
    """
    shards = ParquetShards(stage, cfg.shard_docs, SHARD_SCHEMA)
    counters: dict[str, Any] | None = None
    with (
        open(stage / QUARANTINE, "w", encoding="utf-8") as fh,
        open(stage / BAD_RECORDS, "w", encoding="utf-8") as bad_fh,
    ):
        reader = CorpusReader(
            corpus_uri,
            text_field=cfg.text_field,
            max_bad_records=cfg.max_bad_records,
            max_record_bytes=cfg.max_record_bytes,
            shard=shard,
            on_bad=lambda bad: bad_fh.write(json.dumps({"source": bad.source, "problem": bad.problem}) + "\n"),
        )
        quarantine = Quarantine(fh, cfg.quarantine_samples)
        progress = tqdm(reader, desc=f"clean {shard[0]}/{shard[1]}", unit="doc", disable=None)
        for chunk, (results, chunk_counters) in cleaned_chunks(cfg, iter(progress), workers):
            counters = add_counters(counters, chunk_counters)
            for doc, result in zip(chunk, results, strict=True):
                tally.read(doc)
                if len(result) == 2:
                    quarantine.add_document(result[0], result[1], doc)
                else:
                    shards.add(tally.keep(doc, *result))
        for bad in reader.bad_samples:
            quarantine.add({"rule": "bad_record", "reason": bad.problem, "source": bad.source})
    shards.close()
    assert counters is not None  # cleaned_chunks always ends with the counters of an empty chunk
    return reader, counters


def _shard_counts(tally: _ShardTally, bad_records: int, counters: dict[str, Any]) -> dict[str, int]:
    """A cleaned shard's ``stats.json`` counts (and its metrics)."""
    return {
        "docs_in": tally.docs_in,
        "docs_out": tally.docs_out,
        "bytes_in": tally.bytes_in,
        "bytes_out": tally.bytes_out,
        "bad_records": bad_records,
        "docs_normalized": counters["docs_normalized"],
        "c4_lines_removed": counters["c4_lines_removed"],
        "pii_docs": counters["pii_docs"],
        **{f"pii_{kind}": n for kind, n in counters["pii"].items()},
    }
