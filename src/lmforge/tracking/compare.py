"""The last pipeline runs in an MLflow experiment, side by side (for ``lmforge runs --mlflow``)."""

from __future__ import annotations

import datetime
from typing import Any

from lmforge.config.tracking import TrackingConfig
from lmforge.errors import TrackingError
from lmforge.tracking.runs import KFP_RUN_ID, PARENT_TAG, Tracker
from lmforge.tracking.session import Unavailable

# Figures shown first when present (the parent run holds every stage's final figures as <stage>.<name>).
KEY_FIGURES = (
    "pretrain.val_loss",
    "pretrain.tokens_per_sec",
    "pretrain.mfu",
    "distill.student_val_loss",
    "evaluate.student_perplexity",
    "evaluate.student_bits_per_byte",
    "evaluate.student_exact_match",
    "evaluate.int8_dynamic_perplexity",
    "evaluate.passed",
)


def compare_runs(
    tracking_uri: str | None = None,
    experiment: str | None = None,
    n: int = 10,
    *,
    cfg: TrackingConfig | None = None,
) -> list[dict[str, Any]]:
    """Rows for the last ``n`` pipeline runs (newest first): identity, status, then their final figures.

    Each row: ``run_id``, ``name``, ``kfp_run_id``, ``status``, ``started`` (UTC, ISO 8601), ``preset``,
    ``pipeline_version``, then the :data:`KEY_FIGURES` present and every other ``<stage>.<name>`` metric.

    Raises:
        TrackingError: no tracking URI is configured or the server did not answer.
    """
    base = cfg or TrackingConfig()
    settings = base.model_copy(update={"experiment": experiment}) if experiment else base
    tracker = Tracker(settings, tracking_uri=tracking_uri)
    session = tracker.session
    if session is None:
        raise TrackingError("no MLflow tracking URI: pass one or set MLFLOW_TRACKING_URI")
    try:
        runs = session.search_runs(
            "search pipeline runs",
            # Top-level runs of pipeline runs: lmforge's own parents and those KFP's MLflow integration made.
            f"tags.`{KFP_RUN_ID}` LIKE '%' and tags.`{PARENT_TAG}` IS NULL",
            max_results=n,
            order_by=["attributes.start_time DESC"],
        )
    except Unavailable as exc:
        raise TrackingError(f"MLflow at {session.display_uri} did not answer: {exc}") from exc
    rows = []
    for run in runs:
        tags, metrics = run.data.tags, run.data.metrics
        started = datetime.datetime.fromtimestamp((run.info.start_time or 0) / 1000, tz=datetime.UTC)
        row: dict[str, Any] = {
            "run_id": run.info.run_id,
            "name": run.info.run_name,
            "kfp_run_id": tags.get(KFP_RUN_ID),
            "status": run.info.status,
            "started": started.isoformat(timespec="seconds"),
            "preset": tags.get("lmforge.preset"),
            "pipeline_version": tags.get("lmforge.pipeline_version"),
        }
        row |= {key: metrics[key] for key in KEY_FIGURES if key in metrics}
        row |= {key: metrics[key] for key in sorted(metrics) if key not in row}
        rows.append(row)
    return rows


IDENTITY = ("name", "kfp_run_id", "status", "started", "preset", "pipeline_version")


def side_by_side(rows: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """``rows`` (from :func:`compare_runs`) as lines of a table with one column per run, as MLflow compares runs.

    The lines: the runs' identity (:data:`IDENTITY`), then the :data:`KEY_FIGURES` any run has, then every
    other figure whose value differs between the runs (with one run: none).
    """
    figures = [key for key in dict.fromkeys(k for row in rows for k in row) if key not in ("run_id", *IDENTITY)]
    differing = [key for key in figures if key not in KEY_FIGURES and len({repr(row.get(key)) for row in rows}) > 1]
    lines = [key for key in KEY_FIGURES if key in figures] + differing
    return [(key, [_cell(row.get(key)) for row in rows]) for key in (*IDENTITY, *lines)]


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    return f"{value:.5g}" if isinstance(value, float) else str(value)
