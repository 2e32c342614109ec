"""The ``merge_shards`` stage: the cleaned shards merged in corpus order, without the dedup plan's removals."""

from __future__ import annotations

import heapq
import json
import logging
import shutil
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge import report_html
from lmforge.artifacts import staged_output, write_manifest
from lmforge.config import CleanConfig
from lmforge.data.cleaning import Quarantine
from lmforge.errors import InputDataError
from lmforge.formats.cleaned import BAD_RECORDS, KIND, QUARANTINE, REPORT, STATS, ParquetShards, shard_rows
from lmforge.formats.dedup import EXACT_RULE, NEAR_RULE, read_removed
from lmforge.results import StageResult

log = logging.getLogger("lmforge.clean")


def run(
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
        out = ParquetShards(stage, cfg.shard_docs)
        with open(stage / QUARANTINE, "w", encoding="utf-8") as fh:
            quarantine = Quarantine(fh, cfg.quarantine_samples)
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


def _shard_quarantines(shards: list[Path], quarantine: Quarantine) -> list[dict[str, Any]]:
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
    shards: list[Path], removed_keys: dict[int, tuple[str, int]], out: ParquetShards, quarantine: Quarantine
) -> _Merged:
    """Write the shards' documents to ``out`` in corpus order; quarantine those ``removed_keys`` names instead,
    each with the id of the document it duplicates."""
    targets = {kept for _, kept in removed_keys.values()}
    kept_ids: dict[int, str] = {}
    merged = _Merged()
    for row in heapq.merge(*(shard_rows(d) for d in shards), key=lambda row: row["key"]):
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
