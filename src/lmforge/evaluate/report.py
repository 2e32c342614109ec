"""The evaluation report: one self-contained HTML page and a Markdown summary of ``results.json``.

The page has no external scripts, styles or fonts: plots are embedded PNGs, styles inline. Sections:
summary, gate checks, model comparison (table and bar charts of quality, size and speed), generation
metrics and samples, loss curves, the training plan against what each stage measured, data-stage summary,
TensorRT status, method.
"""

from __future__ import annotations

import html
import json
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from lmforge.contracts import scale_text
from lmforge.evaluate.gate import check_mark, headline_lines
from lmforge.evaluate.harness import all_skipped, skip_lines
from lmforge.report_html import bar_plot, breakable, charts, details, figure_png, line_plot, page, scroll_box, table

log = logging.getLogger("lmforge.evaluate")

MODEL_LABELS: dict[str, str] = {
    "base": "base (pretrained)",
    "teacher": "teacher (LoRA merged)",
    "student": "student (distilled)",
    "onnx_fp32": "ONNX FP32",
    "int8_dynamic": "INT8 dynamic",
    "int8_qdq": "INT8 Q/DQ",
    "tensorrt": "TensorRT engine",
}
"""Rows always shown in the comparison, in this order; other evaluated models follow."""

SCALES: dict[str, str] = {
    label: f"{label} ({scale_text(metric)})"
    for label, metric in (("EM", "exact_match"), ("F1", "f1"), ("BLEU", "bleu"), ("ROUGE-L", "rouge_l"))
}
"""Q&A metric labels with their scales (:data:`~lmforge.contracts.QA_METRIC_SCALES`)."""

QUALITY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("label", "model"),
    ("perplexity", "perplexity"),
    ("bits_per_byte", "bits/byte"),
    ("exact_match", SCALES["EM"]),
    ("f1", SCALES["F1"]),
    ("bleu", SCALES["BLEU"]),
    ("rouge_l", SCALES["ROUGE-L"]),
    ("answer_loss", "answer loss"),
    ("empty_answer_fraction", "empty answers"),
)
SPEED_COLUMNS: tuple[tuple[str, str], ...] = (
    ("label", "model"),
    ("status", "status"),
    ("size_mb", "size MB"),
    ("p50_ms", "p50 ms (b1)"),
    ("p99_ms", "p99 ms (b1)"),
    ("p99_ms_b8", "p99 ms (b8)"),
    ("tokens_per_s", "tokens/s (b8)"),
)
"""The model comparison as two tables (quality; size and speed), each narrow enough to show whole on a page."""
TABLE_COLUMNS: tuple[tuple[str, str], ...] = (
    *QUALITY_COLUMNS[:1],
    SPEED_COLUMNS[1],
    *QUALITY_COLUMNS[1:],
    *SPEED_COLUMNS[2:],
)
"""Every compared figure in one table (the Markdown summary)."""


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
    if name == "tensorrt":  # the reason is shown under the table and in the TensorRT section, not in the cell
        return str((results.get("tensorrt") or {}).get("status") or "absent")
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
                "bits_per_byte": entry.get("bits_per_byte"),
                "exact_match": entry.get("exact_match"),
                "f1": entry.get("f1"),
                "bleu": entry.get("bleu"),
                "rouge_l": entry.get("rouge_l"),
                "answer_loss": entry.get("answer_loss"),
                "empty_answer_fraction": entry.get("empty_answer_fraction"),
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
        mark = check_mark(check)
        ok = {"PASS": "pass", "FAIL": "fail"}.get(mark, "skip")
        threshold = check.get("threshold")
        limit = "—" if not _finite(threshold) else f"{threshold:.4g}"
        rows.append(
            f"<tr><td>{breakable(str(check.get('name')))}</td><td>{shown}</td><td>{limit}</td>"
            f'<td class="{ok}">{mark}</td>'
            f'<td class="text">{breakable(str(check.get("reason", "")))}</td></tr>'
        )
    head = "".join(f"<th>{h}</th>" for h in ("check", "value", "threshold", "result", "reason"))
    return f'<p>Gate: <span class="{klass}">{verdict}</span></p>' + scroll_box(
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


def grouped_bar_plot(groups: Mapping[str, Mapping[str, float]], *, title: str, ylabel: str) -> str:
    """Bars per model (x) and series (colour): ``{series: {model: value}}``, as an embedded PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(m for series in groups.values() for m in series))
    width = 0.8 / max(len(groups), 1)
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    for i, (series, values) in enumerate(groups.items()):
        xs = [j + (i - (len(groups) - 1) / 2) * width for j, m in enumerate(models) if m in values]
        ax.bar(xs, [values[m] for m in models if m in values], width=width, label=series)
    ax.set_xticks(range(len(models)), models, rotation=20)
    ax.set(title=title, ylabel=ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    return figure_png(fig)


def _comparison_html(rows: Sequence[Mapping[str, Any]], trt: Mapping[str, Any] | None = None) -> str:
    body = "".join(
        table([h for _, h in columns], [[row[k] for k, _ in columns] for row in rows])
        for columns in (QUALITY_COLUMNS, SPEED_COLUMNS)
    )
    if trt and trt.get("reason"):
        body += f'<p class="note">TensorRT engine: {breakable(tensorrt_status_text(trt))}</p>'
    plots = []
    quality = {
        series: {r["label"]: r[key] for r in rows if _finite(r[key])}
        for key, series in (("perplexity", "perplexity"), ("bits_per_byte", "bits/byte"))
    }
    if quality["perplexity"]:
        plots.append(
            bar_plot(quality["perplexity"], title="Quality: held-out perplexity (lower is better)", ylabel="perplexity")
        )
    if quality["bits/byte"]:
        plots.append(
            bar_plot(quality["bits/byte"], title="Quality: bits per byte (lower is better)", ylabel="bits/byte")
        )
    answers = (("exact_match", SCALES["EM"]), ("f1", SCALES["F1"]), ("rouge_l", SCALES["ROUGE-L"]))
    title = "Quality: held-out Q&A (higher is better)"
    plots.append(_grouped_chart(rows, answers, title=title, ylabel="score (0–1)"))
    sized = {r["label"]: r["size_mb"] for r in rows if _finite(r["size_mb"])}
    if sized:
        plots.append(bar_plot(sized, title="Size: weight files", ylabel="MB"))
    latency = (("p50_ms", "p50"), ("p99_ms", "p99"))
    plots.append(_grouped_chart(rows, latency, title="Speed: forward latency, batch 1 (lower is better)", ylabel="ms"))
    throughput = {r["label"]: r["tokens_per_s"] for r in rows if _finite(r["tokens_per_s"])}
    if throughput:
        plots.append(bar_plot(throughput, title="Speed: tokens/s at batch 8 (higher is better)", ylabel="tokens/s"))
    return body + charts([chart for chart in plots if chart])


def _grouped_chart(
    rows: list[dict[str, Any]], keys: tuple[tuple[str, str], ...], *, title: str, ylabel: str
) -> str | None:
    """A grouped bar chart of ``(row key, series name)`` pairs over the models; ``None`` when nothing is finite."""
    series = {name: {r["label"]: r[key] for r in rows if _finite(r[key])} for key, name in keys}
    series = {name: values for name, values in series.items() if values}
    return grouped_bar_plot(series, title=title, ylabel=ylabel) if series else None


def _generation_html(results: Mapping[str, Any]) -> str:
    gen = results.get("generation") or {}
    if gen.get("status") != "evaluated":
        reason = html.escape(str(gen.get("reason") or "not run"))
        return f'<p>Generation metrics: <span class="skip">skipped: {reason}</span></p>'
    models = results.get("models") or {}
    scored = {name: e["generation"] for name, e in models.items() if isinstance(e.get("generation"), dict)}
    source = html.escape(str(gen.get("heldout_fraction_source")))
    body = (
        f"<p>{gen.get('prompts')} held-out prompts from <code>{breakable(str(gen.get('qa_uri')))}</code> "
        f"(heldout_fraction {gen.get('heldout_fraction')}, from {source}); "
        f"greedy decoding, at most {gen.get('max_new_tokens')} new tokens.</p>"
    )
    body += table(
        ["model", "prompts", SCALES["EM"], SCALES["F1"], SCALES["BLEU"], SCALES["ROUGE-L"], "empty answers"],
        [
            [
                MODEL_LABELS.get(n, n),
                g["prompts"],
                g["exact_match"],
                g["f1"],
                g["bleu"],
                g["rouge_l"],
                g["empty_predictions"],
            ]
            for n, g in scored.items()
        ],
    )
    body += f'<p class="note">sacrebleu signature: <code>{breakable(str(gen.get("bleu_signature")))}</code></p>'
    sample_rows = gen.get("samples") or []
    if sample_rows:
        names = list(dict.fromkeys(m for row in sample_rows for m in row.get("answers", {})))
        body += "<h3>Samples</h3>" + table(
            ["prompt", "reference(s)", *[MODEL_LABELS.get(n, n) for n in names]],
            [
                [row["prompt"], " | ".join(row["references"]), *[row["answers"].get(n) or "(empty)" for n in names]]
                for row in sample_rows
            ],
            preformatted=True,
        )
    return body


def _data_html(data: Mapping[str, Any]) -> str:
    parts = []
    clean = data.get("clean")
    if clean:
        metrics = clean.get("metrics") or {}
        keys = ("docs_in", "docs_out", "bytes_in", "bytes_out", "duplicate_rate")
        parts.append(f"<p>Cleaned corpus from <code>{breakable(str(clean.get('input')))}</code>.</p>")
        parts.append(table(["figure", "value"], [[k, metrics.get(k)] for k in keys if k in metrics]))
        removed = {k: v for k, v in (clean.get("removed") or {}).items() if v}
        if removed:
            parts.append(table(["rule", "documents removed"], [[k, v] for k, v in removed.items()]))
    else:
        parts.append('<p class="note">No cleaned-corpus statistics given to the evaluation.</p>')
    tokens = data.get("tokens")
    if tokens:
        splits = tokens.get("splits") or {}
        parts.append(
            table(
                ["split", "tokens", "documents"],
                [[name, s.get("tokens"), s.get("documents")] for name, s in splits.items()],
            )
        )
        parts.append(f'<p class="note">Vocabulary size {tokens.get("vocab_size")}.</p>')
    return "\n".join(parts)


def _production_text(results: Mapping[str, Any]) -> str:
    production = results.get("production") or {}
    if production.get("status") == "found":
        return f"production release {production.get('version')}"
    return f"no production release ({production.get('reason') or 'not looked up'})"


def _curves_html(histories: Mapping[str, Mapping[str, Any]]) -> str:
    parts = []
    for name, history in histories.items():
        series = loss_series(history)
        if series:
            parts.append(line_plot(series, title=f"{MODEL_LABELS.get(name, name)}: loss", xlabel="step", ylabel="loss"))
    if not parts:
        return '<p class="note">No training history found next to the evaluated models.</p>'
    return charts(parts)


PLAN_COLUMNS = ("stage", "figure", "planned", "actual", "actual / planned")


def plan_rows(plan_vs_actual: Mapping[str, Any] | None) -> list[list[Any]]:
    """The "Plan against actual" table's rows (:data:`PLAN_COLUMNS`); none without a plan."""
    rows = (plan_vs_actual or {}).get("rows") or []
    return [[row["stage"], row["figure"], row["planned"], row["actual"], row["ratio"]] for row in rows]


def _plan_sources(plan_vs_actual: Mapping[str, Any]) -> str:
    sources = plan_vs_actual.get("mfu_sources") or {}
    return "Planned MFU: " + "; ".join(f"{stage} {source}" for stage, source in sources.items()) + "."


def _plan_html(plan_vs_actual: Mapping[str, Any] | None) -> str:
    if not plan_vs_actual:
        return '<p class="note">No training plan was given to the evaluation (preflight plans with a preset).</p>'
    note = f"{plan_vs_actual.get('note', '')} {_plan_sources(plan_vs_actual)}"
    return table(PLAN_COLUMNS, plan_rows(plan_vs_actual)) + f'<p class="note">{html.escape(note)}</p>'


def _method_html(results: Mapping[str, Any]) -> str:
    context, stride = results.get("context", "?"), results.get("stride", results.get("context", "?"))
    overlap = "non-overlapping" if stride == context else f"sliding, stride {stride}"
    return (
        f'<p class="note">Perplexity: rolling log-likelihood over the first {results.get("eval_tokens", "?")} '
        f"held-out tokens ({results.get('eval_bytes') or '?'} bytes), preceded by the EOS token so every token is "
        f"scored once; forward passes of at most {context} tokens, {overlap}. Each pass after the first scores "
        f"the next {stride} tokens with the {context} tokens before them as history (the last pass ends at the "
        "end of the text); with stride = context this is lm-evaluation-harness's loglikelihood_rolling. NLL is "
        "summed in float64; perplexity = exp(mean NLL per token), bits per byte = NLL / (ln 2 · UTF-8 bytes). "
        "Generation: greedy decoding with the KV cache, batched with left padding, on held-out Q&A prompts "
        "(prompt-hash split, the pairs LoRA never trained on); EM and token F1 after SQuAD normalization, best "
        "reference per prompt; corpus BLEU by sacrebleu (signature above); ROUGE-L F by rouge-score with Porter "
        "stemming. Answer loss: mean cross-entropy over the reference-answer tokens of the held-out Q&A examples "
        "(prompt masked, as fine-tuning scores them), the same rows for every model, ONNX ones included. "
        f"Latency: full forward passes of {context}-token inputs, {results.get('latency_runs', '?')} "
        "timed runs after warm-up, at batch 1 and 8; indicative only on shared machines. Size: bytes of the "
        "weight files (safetensors / ONNX incl. external data). Metric differences between runs can be noise: "
        "seeds and data are fixed, but small held-out sets move by whole answers.</p>"
    )


def _run_html(run_id: str | None, preset: str | None) -> str:
    rows = [("run id", run_id or "not given"), ("preset", preset or "not given")]
    return '<dl class="meta">' + "".join(f"<dt>{k}</dt><dd><code>{breakable(v)}</code></dd>" for k, v in rows) + "</dl>"


def _config_html(config: Mapping[str, Any] | None, preset: str | None) -> str:
    if config is None:
        return '<p class="note">The resolved configuration was not given to the report.</p>'
    text = yaml.safe_dump(dict(config), sort_keys=False, allow_unicode=True, width=100)
    base = f"preset {preset} with the run's overrides" if preset else "every stage"
    return details(f"Resolved configuration ({base}), as YAML", f"<pre><code>{html.escape(text)}</code></pre>")


def html_report(
    results: Mapping[str, Any],
    histories: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    run_id: str | None = None,
    preset: str | None = None,
    config: Mapping[str, Any] | None = None,
) -> str:
    """The self-contained evaluation page: summary, gate, comparison, loss curves, plan against actual, data,
    TensorRT, config, method.

    Args:
        results: the evaluation's ``results.json`` content (with ``gate`` and ``passed``).
        histories: training histories by model name, for the loss curves.
        run_id: the pipeline run this evaluation belongs to, shown in the summary.
        preset: the config preset of the run, shown in the summary.
        config: the run's resolved configuration (``PipelineConfig.model_dump(mode="json")``), shown collapsed.
    """
    verdict = "passed" if results.get("passed") else "failed"
    served = results.get("served_model") or "none"
    summary = (
        verdict_html(results.get("verdict") or [])
        + _run_html(run_id, preset)
        + (
            f'<p>Gate <span class="{"pass" if results.get("passed") else "fail"}">{verdict}</span>; '
            f"served model: {html.escape(str(served))}; compared with {html.escape(_production_text(results))}.</p>"
            + "".join(
                f'<p class="{"fail" if line.startswith("WARNING") else "note"}">{html.escape(line)}</p>'
                for line in headline_lines(results.get("headline") or {})
            )
        )
    )
    sections = [
        ("Summary", summary),
        ("Gate", _gate_html(results.get("gate") or {})),
        ("Model comparison", _comparison_html(comparison_rows(results), results.get("tensorrt"))),
        ("Standard evaluations", harness_html(results.get("harness") or {})),
        ("Generation", _generation_html(results)),
        ("Loss curves", _curves_html(histories or {})),
        ("Plan against actual", _plan_html(results.get("plan_vs_actual"))),
        ("Data", _data_html(results.get("data") or {})),
        ("TensorRT", _tensorrt_html(results.get("tensorrt") or {})),
        ("Configuration", _config_html(config, preset)),
        ("Method", _method_html(results)),
    ]
    subtitle = " · ".join(
        part
        for part in (f"run {run_id}" if run_id else "", f"preset {preset}" if preset else "", f"gate {verdict}")
        if part
    )
    return page("lmforge evaluation", sections, subtitle=subtitle)


def _md(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    # one table cell or list line: no pipes, newlines or raw HTML from model output
    return " ".join(str(value).split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def markdown_summary(results: Mapping[str, Any], *, run_id: str | None = None, preset: str | None = None) -> str:
    """A short Markdown version of the report (for a KFP ``Markdown`` output), naming the run and preset if given."""
    gate = results.get("gate") or {}
    run = ", ".join(
        part for part in (f"run `{run_id}`" if run_id else "", f"preset `{preset}`" if preset else "") if part
    )
    lines = [
        f"# lmforge evaluation: {'PASSED' if results.get('passed') else 'FAILED'}",
        "",
        *([run[0].upper() + run[1:] + ".", ""] if run else []),
        f"Served model: `{results.get('served_model') or 'none'}`; compared with {_production_text(results)}; "
        f"TensorRT: {tensorrt_status_text(results.get('tensorrt') or {})}.",
        "",
        *(f"- {_md(line)}" for line in headline_lines(results.get("headline") or {})),
        "",
        *verdict_markdown(results.get("verdict") or []),
        "| " + " | ".join(h for _, h in TABLE_COLUMNS) + " |",
        "|" + "---|" * len(TABLE_COLUMNS),
    ]
    for row in comparison_rows(results):
        lines.append("| " + " | ".join(_md(row[k]) for k, _ in TABLE_COLUMNS) + " |")
    lines += harness_markdown(results.get("harness") or {})
    lines += plan_markdown(results.get("plan_vs_actual"))
    lines += ["", "## Gate", ""]
    for check in gate.get("checks", []):
        mark = check_mark(check)
        lines.append(f"- **{mark}** `{check.get('name')}`: {check.get('reason')}")
    gen = results.get("generation") or {}
    if gen.get("bleu_signature"):
        lines += ["", f"BLEU signature: `{gen['bleu_signature']}`"]
    samples = gen.get("samples") or []
    if samples:
        lines += ["", "## Generation samples", ""]
        for row in samples[:3]:
            lines.append(f"- **{_md(row['prompt'])}** — reference: {_md(row['references'][0])}")
            for name, answer in row.get("answers", {}).items():
                lines.append(f"  - {name}: {_md(answer) if answer else '(empty)'}")
    return "\n".join(lines) + "\n"


def plan_markdown(plan_vs_actual: Mapping[str, Any] | None) -> list[str]:
    """The "Plan against actual" section of the Markdown summary; nothing without a plan."""
    if not plan_vs_actual:
        return []
    lines = ["", "## Plan against actual", "", "| " + " | ".join(PLAN_COLUMNS) + " |", "|" + "---|" * len(PLAN_COLUMNS)]
    lines += ["| " + " | ".join(_md(cell) for cell in row) + " |" for row in plan_rows(plan_vs_actual)]
    return [*lines, "", _md(f"{plan_vs_actual.get('note', '')} {_plan_sources(plan_vs_actual)}")]


def verdict_html(lines: Sequence[str]) -> str:
    """The verdict in words, one sentence per model, at the top of the report."""
    if not lines:
        return ""
    items = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
    return f'<div class="verdict"><p><strong>Verdict</strong></p><ul>{items}</ul></div>'


def verdict_markdown(lines: Sequence[str]) -> list[str]:
    """The verdict as a Markdown section (empty without one)."""
    return ["## Verdict", "", *(f"- {_md(line)}" for line in lines), ""] if lines else []


def harness_rows(harness: Mapping[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Headers and one row per model of the harness scores: ``task metric`` columns (with ``±`` standard errors),
    ``n/a`` where the model skipped every item of the task, and a ``task skipped`` column after a task's metrics
    where some model skipped items (``N of M``: continuations longer than its context)."""
    tasks = harness.get("tasks") or {}
    scores = harness.get("scores") or {}
    skipped = harness.get("skipped") or {}
    columns = []
    for task in tasks:
        metrics = dict.fromkeys(m for s in scores.values() for m in (s.get(task) or {}) if not m.endswith("_stderr"))
        columns += [(task, metric) for metric in metrics]
        if any(task in by_task for by_task in skipped.values()):
            columns.append((task, None))
    headers = ["model", *(f"{task} {metric or 'skipped'}" for task, metric in columns)]
    rows = []
    for model, by_task in scores.items():
        cells: list[Any] = [MODEL_LABELS.get(model, model)]
        for task, metric in columns:
            lost = (skipped.get(model) or {}).get(task)
            if metric is None:
                cells.append(f"{lost['skipped']} of {lost['documents']}" if lost else "0")
                continue
            value = (by_task.get(task) or {}).get(metric)
            stderr = (by_task.get(task) or {}).get(f"{metric}_stderr")
            if value is None and all_skipped(harness, model, task):
                cells.append("n/a")
            else:
                cells.append(None if value is None else f"{value:.4g} ± {stderr:.2g}" if _finite(stderr) else value)
        rows.append(cells)
    return headers, rows


def harness_html(harness: Mapping[str, Any]) -> str:
    """lm-evaluation-harness scores per model: a table, a chart of each task's accuracy, what each task is."""
    if harness.get("status") != "evaluated":
        reason = html.escape(str(harness.get("reason") or harness.get("errors") or "not run"))
        return f'<p>lm-evaluation-harness: <span class="skip">skipped: {reason}</span></p>'
    headers, rows = harness_rows(harness)
    tasks = harness.get("tasks") or {}
    about = "; ".join(
        f"<code>{html.escape(t)}</code> ({html.escape(str(i.get('output_type')))}, {i.get('documents')} documents"
        + (f", chance {i['chance']:.2g}" if _finite(i.get("chance")) else "")
        + ")"
        for t, i in tasks.items()
    )
    body = (
        f"<p>lm-evaluation-harness {html.escape(str(harness.get('lm_eval_version')))}, its <code>hf</code> model "
        f"class on each PyTorch model directory: {about}. acc is a fraction (0–1); ± one standard error.</p>"
    )
    body += table(headers, rows)
    for line in skip_lines(harness):
        body += f'<p class="note">{breakable(line)}</p>'
    for model, error in (harness.get("errors") or {}).items():
        body += f'<p class="fail">{html.escape(MODEL_LABELS.get(model, model))}: {breakable(error)}</p>'
    series = {
        task: {
            MODEL_LABELS.get(model, model): by_task[task]["acc"]
            for model, by_task in (harness.get("scores") or {}).items()
            if _finite((by_task.get(task) or {}).get("acc"))
        }
        for task in tasks
    }
    series = {task: values for task, values in series.items() if values}
    if series:
        chart = grouped_bar_plot(series, title="Standard evaluations: accuracy (higher is better)", ylabel="acc (0–1)")
        body += charts([chart])
    return body


def harness_markdown(harness: Mapping[str, Any]) -> list[str]:
    """The harness scores as a Markdown table (nothing when the harness did not run)."""
    if harness.get("status") != "evaluated":
        return []
    headers, rows = harness_rows(harness)
    return [
        "",
        "## Standard evaluations (lm-evaluation-harness)",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
        *("| " + " | ".join(_md(cell) for cell in row) + " |" for row in rows),
        *(["", *(f"- {_md(line)}" for line in lines)] if (lines := skip_lines(harness)) else []),
    ]
