"""The end of ``lmforge run``: what was made, in lines a person reads (and a test asserts).

The release (name, version, where), the served model and its size, the gate's decision with the failing checks,
how much of the corpus cleaning kept, and where the report and logs are. Paths are printed whole on their own
line, so a terminal never breaks one in the middle.
"""

from __future__ import annotations

import json
from typing import Any

from lmforge import storage
from lmforge.artifacts import MANIFEST
from lmforge_kfp.pipelines.local_run import LocalRun

MODEL_COLUMNS = (("perplexity", "perplexity"), ("size_mb", "size MB"), ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms"))


def _fmt(value: Any) -> str:
    return "—" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def model_rows(results: dict[str, Any]) -> list[list[str]]:
    """One row per evaluated model: name and the figures of :data:`MODEL_COLUMNS`."""
    return [[name, *(_fmt(row.get(key)) for key, _ in MODEL_COLUMNS)] for name, row in results["models"].items()]


def release_lines(local_run: LocalRun, run_id: str) -> list[str]:
    """Where the release is, and whether this run published it or production already served its models."""
    if not local_run.promoted:
        return ["release: none (the gate did not pass, so promote did not run)"]
    uri = local_run.parameter("promote", "Output")
    manifest = json.loads(storage.read_bytes(storage.join(uri, MANIFEST)))
    name, version = manifest.get("model_name"), manifest.get("version")
    how = "published by this run" if manifest.get("run_id") == run_id else "unchanged: production already serves it"
    return [f"release: {name} {version} ({how})", f"  {uri}"]


def gate_lines(results: dict[str, Any]) -> list[str]:
    """The gate's decision; when it failed, each failing check with its reason."""
    checks = results.get("gate", {}).get("checks", [])
    if results.get("passed"):
        return [f"gate: passed ({len(checks)} checks)"]
    failed = [c for c in checks if not c.get("passed")]
    return [f"gate: FAILED ({len(failed)} of {len(checks)} checks)", *(f"  {c['name']}: {c['reason']}" for c in failed)]


def served_line(results: dict[str, Any]) -> str:
    """The model the release serves and its size."""
    served = results.get("served_model")
    size = (results.get("models", {}).get(served) or {}).get("size_mb")
    return f"served model: {served or 'none'}" + (f", {size:.2f} MB" if isinstance(size, float) else "")


def retention_line(results: dict[str, Any]) -> str:
    """How much of the raw corpus cleaning kept (documents and bytes)."""
    metrics = (results.get("data", {}).get("clean") or {}).get("metrics") or {}
    docs_in, docs_out = metrics.get("docs_in"), metrics.get("docs_out")
    if not docs_in:
        return "data: cleaning figures not recorded"
    line = f"data: cleaning kept {docs_out} of {docs_in} documents ({docs_out / docs_in:.0%})"
    bytes_in, bytes_out = metrics.get("bytes_in"), metrics.get("bytes_out")
    if bytes_in:
        line += f", {bytes_out / 1e6:.2f} of {bytes_in / 1e6:.2f} MB ({bytes_out / bytes_in:.0%})"
    return line


def summary_lines(local_run: LocalRun) -> list[str]:
    """Every line after the model table: release, served model, gate, data, report, logs."""
    evaluation = local_run.output("evaluate", "evaluation")
    results = json.loads((evaluation / "results.json").read_text(encoding="utf-8"))
    return [
        *release_lines(local_run, local_run.run_id),
        served_line(results),
        *gate_lines(results),
        retention_line(results),
        "report:",
        f"  {evaluation / 'report.html'}",
        "logs:",
        f"  {local_run.logs}",
    ]
