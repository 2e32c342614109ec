"""The ``clean`` stage: normalize, filter, redact PII and deduplicate raw documents.

The stage is three steps that also run separately under a pipeline fan-out:

1. :func:`clean_shard` (once per input shard): normalize each document (:class:`Normalize`), run the
   rules of :func:`build_rules` (the first that rejects a document counts the removal and gives the
   reason), redact PII in the survivors and write them with their dedup signatures.
2. :func:`lmforge.data.dedup.run` (once): exact and MinHash LSH dedup over all shards' signatures.
3. :func:`finalize` (once): merge the shards in corpus order without the duplicates into Parquet
   shards ``part-NNNNN.parquet`` (columns ``id``, ``text``, ``source``, ``lang``), a sample of rejected
   documents per rule in ``quarantine.jsonl``, every malformed record (``file:line`` and problem) in
   ``bad_records.jsonl``, ``stats.json`` and an HTML report.

:func:`run` chains the three for a single process; the output is the same for any number of shards.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import multiprocessing
import re
import shutil
import time
import unicodedata
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from lmforge import report_html
from lmforge.artifacts import read_manifest, staged_output, write_manifest
from lmforge.config import CleanConfig
from lmforge.cpus import available_cpus
from lmforge.data.cleaned import KIND, SCHEMA, SHARD_GLOB, STATS
from lmforge.data.corpus import CorpusReader, Document
from lmforge.data.minhash import MinHasher
from lmforge.data.pii import PiiRedactor
from lmforge.data.rules import (
    C4Lines,
    FineWebLines,
    GopherQuality,
    GopherRepetition,
    LanguageFilter,
    MinChars,
    MinWords,
    NonEmpty,
    Rule,
    TextView,
)
from lmforge.data.signatures import EXACT_RULE, NEAR_RULE, exact_digest, read_removed, save_signatures
from lmforge.errors import ConfigError, InputDataError, WorkerLostError
from lmforge.results import StageResult
from lmforge.scratch import scratch_dir
from lmforge.stages import run_stage

__all__ = [
    "Normalize",
    "build_rules",
    "clean_shard",
    "finalize",
    "plan_shards",
    "run",
]

log = logging.getLogger("lmforge.clean")

SHARD_KIND = "cleaned-shard"
QUARANTINE = "quarantine.jsonl"
BAD_RECORDS = "bad_records.jsonl"  # every malformed input record with file:line and the problem
REPORT = "report.html"
# A cleaned shard also carries each document's corpus position, the merge and dedup key.
SHARD_SCHEMA = SCHEMA.append(pa.field("key", pa.int64()))
QUARANTINE_TEXT_CHARS = 2000
_ROW_GROUP_DOCS = 1000
_ROW_GROUP_BYTES = 16 << 20
_NO_SIGNATURE = np.empty(0, dtype=np.uint32)  # near dedup off: signatures are empty

# C0/C1 controls except tab and newline, and the byte order mark that editors leave at the start of files
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ufeff]")
# A run of whitespace without a newline that is not already a single space; matching lone spaces too
# makes ``sub`` several times slower on ordinary prose.
_HSPACE = re.compile(r"[^\S\n]{2,}|[^\S\n ]")
_ODD_SPACE = re.compile(r"[^\S\n ]")  # whitespace other than newline and space: a one-class scan, faster


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
        if "  " in out or _ODD_SPACE.search(out):  # else _HSPACE has nothing to replace
            out = _HSPACE.sub(" ", out)
        out = out.replace(" \n", "\n").replace("\n ", "\n").strip()
        if out != text:
            self.changed += 1
        return out


def build_rules(cfg: CleanConfig) -> list[Rule]:
    """The per-document rules of ``cfg`` in the order they run (FineWeb's order: language ID, Gopher
    repetition, Gopher quality, C4, FineWeb). Dedup runs after all of them, over the survivors."""
    rules: list[Rule] = [NonEmpty(), MinChars(cfg.min_chars), MinWords(cfg.min_words)]
    if cfg.language.enabled:
        rules.append(LanguageFilter(cfg.language))
    if cfg.gopher_repetition.enabled:
        rules.append(GopherRepetition(cfg.gopher_repetition))
    if cfg.gopher_quality.enabled:
        rules.append(GopherQuality(cfg.gopher_quality))
    if cfg.c4.enabled:
        rules.append(C4Lines(cfg.c4))
    if cfg.fineweb.enabled:
        rules.append(FineWebLines(cfg.fineweb))
    return rules


class _ParquetShards:
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


class _Quarantine:
    """``quarantine.jsonl``: at most ``per_rule`` rejected documents per rule, with the reason."""

    def __init__(self, fh: Any, per_rule: int) -> None:
        self.fh = fh
        self.per_rule = per_rule
        self.kept: Counter[str] = Counter()

    def add(self, record: dict[str, Any]) -> None:
        if self.kept[record["rule"]] < self.per_rule:
            self.kept[record["rule"]] += 1
            self.fh.write(json.dumps(record, ensure_ascii=False) + "\n")

    def add_document(self, rule: str, reason: str, doc: Document | dict[str, Any]) -> None:
        text = doc.text if isinstance(doc, Document) else doc["text"]
        source = doc.source if isinstance(doc, Document) else doc["source"]
        doc_id = doc.id if isinstance(doc, Document) else doc["id"]
        cut = text[:QUARANTINE_TEXT_CHARS]
        record = {"rule": rule, "reason": reason, "source": source, "id": doc_id, "text": cut}
        self.add({**record, "truncated": len(text) > len(cut)})


_CHUNK_DOCS = 32  # documents per task for a worker process: amortizes pickling; small, so the last ends soon
_POOL_MIN_CHUNKS = 16  # smaller shards are cleaned in-process: a worker process takes about half a second to start
_BACKLOG_CHUNKS = 8  # chunks queued per worker process: covers a row group written and a chunk cleaned here
_HELD_CHUNKS = 2 * _BACKLOG_CHUNKS  # chunks held per worker (queued, or cleaned and waiting for their turn)


class _DocCleaner:
    """The per-document work of :func:`clean_shard`: normalize, rules, PII redaction, dedup signature.

    One lives in the stage's process, or one in each worker process of its pool; :meth:`counters` hands
    over what it counted since the last call, so that the stage can add up the workers' counts.
    """

    def __init__(self, cfg: CleanConfig) -> None:
        self.normalize = Normalize(cfg.unicode_form)
        self.rules = build_rules(cfg)
        self.redact = PiiRedactor(cfg.pii)
        self.hasher = MinHasher(cfg.near_dedup) if cfg.near_dedup.enabled else None

    def clean(self, text: str) -> tuple[str, str] | tuple[str, str, bytes, np.ndarray]:
        """``(rule, reason)`` for a rejected document; ``(text, lang, exact digest, signature)`` for a kept one."""
        view = TextView(self.normalize(text))
        rejected = next(((r.name, why) for r in self.rules if (why := r(view)) is not None), None)
        if rejected is not None:
            return rejected
        text = self.redact(view.text)
        if text != view.text:
            view.replace_text(text)
        signature = self.hasher.view_signature(view) if self.hasher is not None else _NO_SIGNATURE
        return text, view.lang, exact_digest(text), signature

    def clean_chunk(self, texts: list[str]) -> _Cleaned:
        """The results of :meth:`clean` for ``texts``, in their order, and the counters they moved."""
        return [self.clean(text) for text in texts], self.counters()

    def counters(self) -> dict[str, Any]:
        """The counts since the last call (rules in their order, normalization, C4 lines, PII); then reset."""
        out = {
            "removed": {r.name: r.removed for r in self.rules},
            "reasons": {r.name: Counter(r.reasons) for r in self.rules},
            "docs_normalized": self.normalize.changed,
            "c4_lines_removed": sum(getattr(r, "lines_removed", 0) for r in self.rules),
            "pii_docs": self.redact.docs,
            "pii": Counter(self.redact.counts),
        }
        for rule in self.rules:
            rule.removed = 0
            rule.reasons.clear()
            if hasattr(rule, "lines_removed"):
                rule.lines_removed = 0
        self.normalize.changed = self.redact.docs = 0
        self.redact.counts = Counter(dict.fromkeys(self.redact.counts, 0))
        return out


def _add_counters(total: dict[str, Any] | None, part: dict[str, Any]) -> dict[str, Any]:
    if total is None:
        return part
    for name, n in part["removed"].items():
        total["removed"][name] += n
        total["reasons"][name].update(part["reasons"][name])
    for key in ("docs_normalized", "c4_lines_removed", "pii_docs"):
        total[key] += part[key]
    total["pii"].update(part["pii"])
    return total


_WORKER: _DocCleaner | None = None  # the cleaner of a pool worker process (set by its initializer)


def _init_worker(cfg: CleanConfig) -> None:
    global _WORKER
    _WORKER = _DocCleaner(cfg)


_Cleaned = tuple[list[Any], dict[str, Any]]  # a chunk's results (in its order) and the counters it moved
_Held = deque[tuple[list[Document], "Future[_Cleaned] | _Cleaned"]]  # chunks in corpus order, with their results


def _clean_chunk(texts: list[str]) -> _Cleaned:
    assert _WORKER is not None, "_init_worker did not run in this process"
    return _WORKER.clean_chunk(texts)


def _cleaned_chunks(cfg: CleanConfig, docs: Iterator[Document], workers: int) -> Iterator[tuple[list[Document], Any]]:
    """``(documents, (results, counters))`` for consecutive chunks of ``docs``, in corpus order.

    With one worker, or a shard too small to repay starting processes, everything runs here. Otherwise this
    process is one of the ``workers``: a pool of ``workers - 1`` processes gets a backlog of
    ``_BACKLOG_CHUNKS`` chunks each, deep enough to outlast this process's pauses (a Parquet row group
    written, a chunk cleaned here); whenever the backlog is full, this process cleans the next chunk
    itself. When the input ends, it takes back the chunks the pool has not started and cleans them too, so
    that the processes finish within a few chunks of each other. At most ``_HELD_CHUNKS * workers`` chunks are
    held (memory stays bounded by the chunk size). The last item carries an empty chunk and counters.
    """
    chunks = _chunked(docs, _CHUNK_DOCS)
    head = list(itertools.islice(chunks, _POOL_MIN_CHUNKS))
    here = _DocCleaner(cfg)

    def clean_here(chunk: list[Document]) -> _Cleaned:
        return here.clean_chunk([d.text for d in chunk])

    if workers <= 1 or len(head) < _POOL_MIN_CHUNKS:
        for chunk in itertools.chain(head, chunks):
            yield chunk, clean_here(chunk)
        yield [], ([], here.counters())
        return
    context = multiprocessing.get_context("spawn")  # no fork of a process that runs pyarrow's threads
    helpers = workers - 1
    pool = ProcessPoolExecutor(helpers, mp_context=context, initializer=_init_worker, initargs=(cfg,))
    try:
        held: _Held = deque()
        for chunk in itertools.chain(head, chunks):
            backlog = sum(1 for _, result in held if _pending(result))
            if backlog < _BACKLOG_CHUNKS * helpers:
                held.append((chunk, pool.submit(_clean_chunk, [d.text for d in chunk])))
            else:
                held.append((chunk, clean_here(chunk)))
            while held and (len(held) > _HELD_CHUNKS * workers or not _pending(held[0][1])):
                done, result = held.popleft()
                yield done, _resolved(done, result)
        _take_back(held, clean_here)
        while held:
            done, result = held.popleft()
            yield done, _resolved(done, result)
    finally:  # stopped early (bad input, a failed write): the backlog is dropped, not cleaned
        pool.shutdown(cancel_futures=True)
    yield [], ([], here.counters())


def _take_back(held: _Held, clean_here: Callable[[list[Document]], _Cleaned]) -> None:
    """Clean here, from the end, the chunks of ``held`` that the pool has not begun (it works from the front)."""
    for at in reversed(range(len(held))):
        chunk, result = held[at]
        if not isinstance(result, Future):
            continue
        if not result.cancel():
            return  # begun or queued in the pool, as is every chunk before it
        held[at] = (chunk, clean_here(chunk))


def _pending(result: Future[_Cleaned] | _Cleaned) -> bool:
    return isinstance(result, Future) and not result.done()


def _resolved(chunk: list[Document], result: Future[_Cleaned] | _Cleaned) -> _Cleaned:
    if not isinstance(result, Future):
        return result
    try:
        return result.result()
    except BrokenProcessPool as err:
        raise WorkerLostError(
            f"a cleaning worker process died while it held documents {chunk[0].source} to {chunk[-1].source} "
            f"(most often the kernel killed it for memory: raise the pod's memory limit or lower clean.workers): {err}"
        ) from err


def _chunked(docs: Iterator[Document], size: int) -> Iterator[list[Document]]:
    chunk: list[Document] = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def plan_shards(*, shard_count: int) -> StageResult:
    """The ``plan_shards`` stage: shard indices ``0 .. shard_count-1`` for the cleaning fan-out.

    Raises:
        ConfigError: ``shard_count`` is below 1.
    """
    if shard_count < 1:
        raise ConfigError(f"shard_count: must be at least 1, got {shard_count}")
    return StageResult(metrics={"shards": float(shard_count)}, summary={"shard_indices": list(range(shard_count))})


@dataclass
class _ShardTally:
    """What :func:`clean_shard` counts of its documents, and the keys and signatures of those it keeps."""

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


def clean_shard(
    cfg: CleanConfig, *, corpus_uri: str, shard_index: int, shard_count: int, shard: str | Path
) -> StageResult:
    """Clean shard ``shard_index`` of ``shard_count`` of the corpus: rules, PII, dedup signatures.

    Writes a ``cleaned-shard`` artifact: surviving documents (``part-*.parquet`` with their corpus
    ``key``), their signatures for :func:`lmforge.data.dedup.run`, the shard's quarantine sample and
    counters in ``stats.json``. A shard may be empty; :func:`finalize` decides whether the corpus is.
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
    shards = _ParquetShards(stage, cfg.shard_docs, SHARD_SCHEMA)
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
        quarantine = _Quarantine(fh, cfg.quarantine_samples)
        progress = tqdm(reader, desc=f"clean {shard[0]}/{shard[1]}", unit="doc", disable=None)
        for chunk, (results, chunk_counters) in _cleaned_chunks(cfg, iter(progress), workers):
            counters = _add_counters(counters, chunk_counters)
            for doc, result in zip(chunk, results, strict=True):
                tally.read(doc)
                if len(result) == 2:
                    quarantine.add_document(result[0], result[1], doc)
                else:
                    shards.add(tally.keep(doc, *result))
        for bad in reader.bad_samples:
            quarantine.add({"rule": "bad_record", "reason": bad.problem, "source": bad.source})
    shards.close()
    assert counters is not None  # _cleaned_chunks always ends with the counters of an empty chunk
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


def _shard_rows(shard_dir: Path) -> Iterator[dict[str, Any]]:
    manifest = read_manifest(shard_dir, verify=True)
    if manifest.get("kind") != SHARD_KIND:
        raise InputDataError(f"{shard_dir}: artifact kind {manifest.get('kind')!r}, expected {SHARD_KIND!r}")
    for name in sorted(n for n in manifest.get("files", {}) if Path(n).match(SHARD_GLOB)):
        for batch in pq.ParquetFile(Path(shard_dir, name)).iter_batches(batch_size=1024):
            yield from batch.to_pylist()


def finalize(
    cfg: CleanConfig,
    *,
    corpus_uri: str,
    shards: Sequence[str | Path],
    plan: str | Path,
    cleaned: str | Path,
    seconds: float | None = None,
) -> StageResult:
    """Merge cleaned shards in corpus order, dropping the documents the dedup plan removes.

    Raises:
        InputDataError: no shard read a document, or no document survives cleaning.
    """
    start = time.perf_counter()
    shards = [Path(d) for d in shards]
    shard_stats = [json.loads((d / STATS).read_text(encoding="utf-8")) for d in shards]
    removed_keys = read_removed(plan)
    totals = _ShardTotals.add_up(shard_stats)
    docs_in = totals.counts["docs_in"]
    if docs_in == 0:
        raise InputDataError(f"corpus {corpus_uri}: no documents ({totals.counts['bad_records']} bad records)")

    with staged_output(cleaned) as stage:
        out = _ParquetShards(stage, cfg.shard_docs)
        with open(stage / QUARANTINE, "w", encoding="utf-8") as fh:
            quarantine = _Quarantine(fh, cfg.quarantine_samples)
            bad_records = _shard_quarantines(shards, quarantine)
            merged = _merge_shards(shards, removed_keys, out, quarantine)
            for record in bad_records:
                quarantine.add(record)
        _concatenate(shards, BAD_RECORDS, stage / BAD_RECORDS)
        out.close()
        removed = totals.removed_with_dedup(merged.dedup_removed)
        if merged.docs_out == 0:
            detail = ", ".join(f"{name}: {n}" for name, n in removed.items() if n)
            raise InputDataError(f"corpus {corpus_uri}: all {docs_in} documents were removed by cleaning ({detail})")
        elapsed = (seconds or 0.0) + (time.perf_counter() - start)
        if seconds is None:
            elapsed += max(st["seconds"] for st in shard_stats)
        clusters = len({kept for _, kept in removed_keys.values()})
        metrics = _merged_metrics(totals.counts, merged, removed, clusters, elapsed)
        stats = {
            "input": corpus_uri,
            "files": totals.files,
            "shards_in": len(shards),
            "metrics": metrics,
            "removed": removed,
            "reasons": {rule: dict(sorted(c.items())) for rule, c in totals.reasons.items()},
            "shards": out.shards,
            "quarantined": dict(quarantine.kept),
        }
        (stage / STATS).write_text(json.dumps(stats, indent=2), encoding="utf-8")
        html = _report(corpus_uri, metrics, removed, stats["reasons"])
        (stage / REPORT).write_text(html, encoding="utf-8")
        write_manifest(stage, KIND, inputs={"corpus": corpus_uri}, config=cfg.model_dump(), metrics=metrics)

    log.info(
        "cleaned %s: %d of %d documents kept (%s), %d bad records, %.0f docs/s",
        corpus_uri,
        merged.docs_out,
        docs_in,
        ", ".join(f"{name} -{n}" for name, n in removed.items()),
        totals.counts["bad_records"],
        metrics["docs_per_sec"],
    )
    summary = {"output": str(cleaned), "shards": out.shards, "files": totals.files}
    return StageResult(metrics=metrics, html=html, summary=summary)


@dataclass
class _ShardTotals:
    """The cleaned shards' ``stats.json`` added up; ``rules``: the rules in the order they ran."""

    counts: Counter[str] = field(default_factory=Counter)
    removed: Counter[str] = field(default_factory=Counter)
    reasons: dict[str, Counter[str]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    rules: list[str] = field(default_factory=list)

    @classmethod
    def add_up(cls, shard_stats: list[dict[str, Any]]) -> _ShardTotals:
        """The totals of the shards' ``stats.json`` (in shard order)."""
        totals = cls(rules=list(shard_stats[0]["removed"]) if shard_stats else [])
        for st in shard_stats:
            totals.counts.update(st["counts"])
            totals.removed.update(st["removed"])
            for rule, by_reason in st["reasons"].items():
                totals.reasons.setdefault(rule, Counter()).update(by_reason)
            totals.files.extend(st["files"])
        return totals

    def removed_with_dedup(self, dedup_removed: Counter[str]) -> dict[str, int]:
        """Documents removed per rule, in the order the rules ran, then by exact and near dedup."""
        removed = Counter(self.removed)
        removed.update({EXACT_RULE: dedup_removed[EXACT_RULE], NEAR_RULE: dedup_removed[NEAR_RULE]})
        return {name: removed[name] for name in [*self.rules, EXACT_RULE, NEAR_RULE]}


@dataclass
class _Merged:
    """What :func:`_merge_shards` kept and dropped."""

    docs_out: int = 0
    bytes_out: int = 0
    dedup_removed: Counter[str] = field(default_factory=Counter)


def _shard_quarantines(shards: list[Path], quarantine: _Quarantine) -> list[dict[str, Any]]:
    """Add the shards' quarantined documents to ``quarantine``; return their bad-record samples (added last)."""
    bad_records = []
    for d in shards:
        for line in (d / QUARANTINE).read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if record["rule"] == "bad_record":
                bad_records.append(record)
            else:
                quarantine.add(record)
    return bad_records


def _merge_shards(
    shards: list[Path], removed_keys: dict[int, tuple[str, int]], out: _ParquetShards, quarantine: _Quarantine
) -> _Merged:
    """Write the shards' documents to ``out`` in corpus order; quarantine those ``removed_keys`` names instead,
    each with the id of the document it duplicates."""
    targets = {kept for _, kept in removed_keys.values()}
    kept_ids: dict[int, str] = {}
    merged = _Merged()
    for row in heapq.merge(*(_shard_rows(d) for d in shards), key=lambda row: row["key"]):
        key = row["key"]
        if key in targets:
            kept_ids[key] = row["id"]
        if key in removed_keys:
            rule, kept = removed_keys[key]
            merged.dedup_removed[rule] += 1
            what = "exact duplicate" if rule == EXACT_RULE else "near duplicate"
            quarantine.add_document(rule, f"{what} of {kept_ids.get(kept, kept)}", row)
            continue
        merged.docs_out += 1
        merged.bytes_out += len(row["text"].encode("utf-8"))
        out.add(row)
    return merged


def _concatenate(shards: list[Path], name: str, target: Path) -> None:
    """Write the shards' files ``name`` one after the other to ``target``."""
    with open(target, "w", encoding="utf-8") as out:
        for d in shards:
            with open(d / name, encoding="utf-8") as part:
                shutil.copyfileobj(part, out)


def _merged_metrics(
    counts: Counter[str], merged: _Merged, removed: dict[str, int], clusters: int, elapsed: float
) -> dict[str, float]:
    """The cleaned corpus's metrics: documents and bytes in and out, removals per rule, PII, duplicates, speed."""
    docs_in = counts["docs_in"]
    return {
        "docs_in": docs_in,
        "docs_out": merged.docs_out,
        "bytes_in": counts["bytes_in"],
        "bytes_out": merged.bytes_out,
        **{f"removed_{name}": n for name, n in removed.items()},
        "bad_records": counts["bad_records"],
        "docs_normalized": counts["docs_normalized"],
        "c4_lines_removed": counts["c4_lines_removed"],
        "pii_docs": counts["pii_docs"],
        **{k: v for k, v in sorted(counts.items()) if k.startswith("pii_") and k != "pii_docs"},
        "duplicate_clusters": clusters,
        "duplicate_rate": (removed[EXACT_RULE] + removed[NEAR_RULE]) / docs_in,
        "docs_per_sec": docs_in / max(elapsed, 1e-9),
    }


def run(cfg: CleanConfig, *, corpus_uri: str, cleaned: str | Path) -> StageResult:
    """Clean the corpus at ``corpus_uri`` into ``cleaned`` (committed only on success) in one process.

    The same three steps as the pipeline fan-out with one shard: :func:`clean_shard`,
    :func:`lmforge.data.dedup.run`, :func:`finalize`.

    Raises:
        InputDataError: the corpus is missing, has too many malformed records, has no documents, or
            no document survives cleaning.
    """
    start = time.perf_counter()
    with scratch_dir(".lmforge-clean-", Path(cleaned).parent) as scratch:
        shard = Path(scratch, "shard-00000")
        clean_shard(cfg, corpus_uri=corpus_uri, shard_index=0, shard_count=1, shard=shard)
        run_stage("dedup_shards", cfg, {"shards": [shard], "plan": Path(scratch, "dedup")})
        return finalize(
            cfg,
            corpus_uri=corpus_uri,
            shards=[shard],
            plan=Path(scratch, "dedup"),
            cleaned=cleaned,
            seconds=time.perf_counter() - start,
        )


def _report(
    input_uri: str, metrics: dict[str, float], removed: dict[str, int], reasons: dict[str, dict[str, int]]
) -> str:
    plot = report_html.bar_plot(
        {**removed, "bad_record": metrics["bad_records"]},
        title="Documents removed per rule",
        ylabel="documents",
    )
    reason_rows = [(rule, why, n) for rule, by in reasons.items() for why, n in by.items()]
    sections = [
        ("Removals per rule", plot),
        ("Removals per rule and reason", report_html.table(["rule", "reason", "documents"], reason_rows)),
        ("Metrics", report_html.table(["metric", "value"], list(metrics.items()))),
    ]
    return report_html.page("lmforge clean", sections, subtitle=f"input: {input_uri}")
