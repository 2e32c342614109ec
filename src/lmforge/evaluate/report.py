"""The evaluation report: one self-contained HTML page and a Markdown summary of ``results.json``."""

from __future__ import annotations

import html
import json
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lmforge.model.build import HISTORY_FILE
from lmforge.report_html import bar_plot, line_plot, page, table

log = logging.getLogger("lmforge.evaluate")

MODEL_LABELS: dict[str, str] = {
    "teacher": "teacher (LoRA merged)",
    "student": "student (distilled)",
    "onnx_fp32": "ONNX FP32",
    "int8_dynamic": "INT8 dynamic",
    "int8_qdq": "INT8 Q/DQ",
    "tensorrt": "TensorRT engine",
}
"""Rows always shown in the comparison, in this order; other evaluated models follow."""

TABLE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("label", "model"),
    ("status", "status"),
    ("perplexity", "perplexity"),
    ("bits_per_token", "bits/token"),
    ("size_mb", "size MB"),
    ("p50_ms", "p50 ms (b1)"),
    ("p99_ms", "p99 ms (b1)"),
    ("p99_ms_b8", "p99 ms (b8)"),
    ("tokens_per_s", "tokens/s (b8)"),
)


def read_history(model_dir: str | Path) -> dict[str, Any] | None:
    """The ``training_history.json`` next to a trained model, or ``None`` when there is none."""
    path = Path(model_dir, HISTORY_FILE)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        # A broken history only costs a plot; the evaluation itself stays valid.
        log.warning("%s: not valid JSON (%s); no loss curves for it", path, exc.msg)
        return None
    return data if isinstance(data, dict) else None


def _numbers(values: Any) -> list[float] | None:
    if not isinstance(values, list) or not values:
        return None
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return None
    return [float(v) for v in values]


def loss_series(history: Mapping[str, Any]) -> dict[str, tuple[list[float], list[float]]]:
    """Every ``*loss*`` list in a history, against ``step`` or ``eval_step`` by matching length.

    Tolerant of missing keys: a loss list with no matching step list is drawn against its index.
    """
    steps = _numbers(history.get("step"))
    eval_steps = _numbers(history.get("eval_step"))
    series: dict[str, tuple[list[float], list[float]]] = {}
    for key, raw in history.items():
        ys = _numbers(raw)
        if ys is None or "loss" not in key:
            continue
        if key.startswith("eval") and eval_steps and len(eval_steps) == len(ys):
            xs = eval_steps
        elif steps and len(steps) == len(ys):
            xs = steps
        elif eval_steps and len(eval_steps) == len(ys):
            xs = eval_steps
        else:
            xs = [float(i) for i in range(len(ys))]
        series[key] = (xs, ys)
    return series


def _status(results: Mapping[str, Any], name: str) -> str:
    if name == "tensorrt":
        trt = results.get("tensorrt") or {}
        return tensorrt_status_text(trt)
    return "evaluated" if name in (results.get("models") or {}) else "not evaluated"


def tensorrt_status_text(trt: Mapping[str, Any]) -> str:
    """``"built"``, ``"skipped: no GPU"`` and the like."""
    status = str(trt.get("status") or "absent")
    reason = trt.get("reason")
    return f"{status}: {reason}" if reason else status


def comparison_rows(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per model (the canonical ones first, absent ones included) with the compared figures."""
    models: Mapping[str, Any] = results.get("models") or {}
    names = list(MODEL_LABELS) + [n for n in models if n not in MODEL_LABELS]
    rows = []
    for name in names:
        entry = models.get(name) or {}
        batch8 = (entry.get("latency") or {}).get("8") or {}
        rows.append(
            {
                "model": name,
                "label": MODEL_LABELS.get(name, name),
                "status": _status(results, name),
                "perplexity": entry.get("perplexity"),
                "bits_per_token": entry.get("bits_per_token"),
                "size_mb": entry.get("size_mb"),
                "p50_ms": entry.get("p50_ms"),
                "p99_ms": entry.get("p99_ms"),
                "p99_ms_b8": batch8.get("p99_ms"),
                "tokens_per_s": batch8.get("tokens_per_s"),
            }
        )
    return rows


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _gate_html(gate: Mapping[str, Any]) -> str:
    verdict = "PASSED" if gate.get("passed") else "FAILED"
    klass = "pass" if gate.get("passed") else "fail"
    rows = []
    for check in gate.get("checks", []):
        value = check.get("value")
        shown = "—" if value is None else f"{value:.4g}"
        ok = "pass" if check.get("passed") else "fail"
        rows.append(
            f"<tr><td>{html.escape(str(check.get('name')))}</td><td>{shown}</td>"
            f"<td>{check.get('threshold', float('nan')):.4g}</td>"
            f'<td class="{ok}">{ok.upper()}</td><td>{html.escape(str(check.get("reason", "")))}</td></tr>'
        )
    head = "".join(f"<th>{h}</th>" for h in ("check", "value", "threshold", "result", "reason"))
    return (
        f'<p>Gate: <span class="{klass}">{verdict}</span></p>'
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def _tensorrt_html(trt: Mapping[str, Any]) -> str:
    status = str(trt.get("status") or "absent")
    klass = {"built": "pass", "failed": "fail"}.get(status, "skip")
    details = {k: v for k, v in trt.items() if k not in ("status", "reason")}
    body = f'<p>TensorRT engine: <span class="{klass}">{html.escape(tensorrt_status_text(trt))}</span></p>'
    if details:
        body += table(
            ["field", "value"],
            [[k, json.dumps(v) if isinstance(v, dict | list) else v] for k, v in details.items()],
        )
    return body


def _comparison_html(rows: Sequence[Mapping[str, Any]]) -> str:
    body = table([h for _, h in TABLE_COLUMNS], [[row[k] for k, _ in TABLE_COLUMNS] for row in rows])
    evaluated = [r for r in rows if _finite(r["perplexity"])]
    if evaluated:
        body += bar_plot(
            {r["label"]: r["perplexity"] for r in evaluated}, title="Held-out perplexity", ylabel="perplexity"
        )
    sized = [r for r in rows if _finite(r["size_mb"])]
    if sized:
        body += bar_plot({r["label"]: r["size_mb"] for r in sized}, title="Model size", ylabel="MB")
    latency: dict[str, float] = {}
    for r in rows:
        for key, tag in (("p50_ms", "p50"), ("p99_ms", "p99")):
            if _finite(r[key]):
                latency[f"{r['label']} {tag}"] = r[key]
    if latency:
        body += bar_plot(latency, title="Forward latency, batch 1", ylabel="ms")
    return body


def _curves_html(histories: Mapping[str, Mapping[str, Any]]) -> str:
    parts = []
    for name, history in histories.items():
        series = loss_series(history)
        if series:
            parts.append(line_plot(series, title=f"{MODEL_LABELS.get(name, name)}: loss", xlabel="step", ylabel="loss"))
    if not parts:
        return '<p class="note">No training history found next to the evaluated models.</p>'
    return "\n".join(parts)


def _method_html(results: Mapping[str, Any]) -> str:
    return (
        f'<p class="note">Perplexity over the first {results.get("eval_tokens", "?")} held-out tokens in '
        f"non-overlapping windows of {results.get('context', '?')} tokens; each window's first token is "
        "context only, the rest are scored, NLL summed in float64. Latency: full forward passes of "
        f"context-length inputs, {results.get('latency_runs', '?')} timed runs after warm-up, at batch 1 "
        "and 8. Size: bytes of the weight files (safetensors / ONNX incl. external data).</p>"
    )


def html_report(results: Mapping[str, Any], histories: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """The self-contained evaluation page: summary, gate, comparison, loss curves, TensorRT, method."""
    gate = results.get("gate") or {}
    verdict = "passed" if results.get("passed") else "failed"
    served = results.get("served_model") or "none"
    summary = (
        f'<p>Gate <span class="{"pass" if results.get("passed") else "fail"}">{verdict}</span>; '
        f"served model: {html.escape(str(served))}.</p>"
    )
    sections = [
        ("Summary", summary),
        ("Gate", _gate_html(gate)),
        ("Model comparison", _comparison_html(comparison_rows(results))),
        ("Loss curves", _curves_html(histories or {})),
        ("TensorRT", _tensorrt_html(results.get("tensorrt") or {})),
        ("Method", _method_html(results)),
    ]
    return page("lmforge evaluation", sections, subtitle=f"gate {verdict}")


def _md(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|")


def markdown_summary(results: Mapping[str, Any]) -> str:
    """A short Markdown version of the report (for a KFP ``Markdown`` output)."""
    gate = results.get("gate") or {}
    lines = [
        f"# lmforge evaluation: {'PASSED' if results.get('passed') else 'FAILED'}",
        "",
        f"Served model: `{results.get('served_model') or 'none'}`; TensorRT: "
        f"{tensorrt_status_text(results.get('tensorrt') or {})}.",
        "",
        "| " + " | ".join(h for _, h in TABLE_COLUMNS) + " |",
        "|" + "---|" * len(TABLE_COLUMNS),
    ]
    for row in comparison_rows(results):
        lines.append("| " + " | ".join(_md(row[k]) for k, _ in TABLE_COLUMNS) + " |")
    lines += ["", "## Gate", ""]
    for check in gate.get("checks", []):
        mark = "PASS" if check.get("passed") else "FAIL"
        lines.append(f"- **{mark}** `{check.get('name')}`: {check.get('reason')}")
    return "\n".join(lines) + "\n"
