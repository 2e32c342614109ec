"""A parent MLflow run per pipeline run, a nested run per stage, and what each stage logs there.

Correlation follows Kubeflow Pipelines' own MLflow integration (KEP-12862): the parent run carries the tag
``kfp.pipeline_run_id`` (plus ``kfp.pipeline_run_url`` when known), a stage's run carries ``mlflow.parentRunId``
and ``kfp.task_name``. Every stage runs in its own pod, so the parent is *found or created* by that tag: the
first stage to look creates it, the others find it. Two stages that create it at the same moment both see
both runs on their re-read and keep the older one (start time, then run id), the other deleting its own;
``preflight`` runs before every other step, so in the DAG it is the one that creates the parent.

When KFP's MLflow integration is on it has already made the task's nested run and put its id in
``MLFLOW_RUN_ID``: the stage then logs into that run (KFP closes it) instead of making one.

A stage's run gets its resolved config as params (dotted keys, values cut to ``max_param_chars``, credentials
redacted), its per-step training history as metrics (``train_loss``, ``lr``, ``grad_norm``,
``tokens_per_sec``, ``mfu``, ``memory_gb`` per optimizer step, ``eval_loss`` per evaluation), its final
figures (``StageResult.metrics``; a figure with the name of a per-step series is logged as ``<name>_final``),
the gate's checks (``gate.<check>.passed`` / ``.value`` metrics, the reason as tag ``gate.<check>``), scalar
summary facts as ``summary.<key>`` tags, and its small files (:data:`SMALL_FILES` of each output, and the
stage's HTML report as ``report.html``). The parent gets each stage's final figures as ``<stage>.<name>``, so
MLflow's run comparison shows pipeline runs side by side.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, Unpack

from lmforge import __version__
from lmforge.config.tracking import TrackingConfig
from lmforge.evaluate.gate import check_mark
from lmforge.results import StageResult
from lmforge.tracking.redact import Scrubber, flatten, truncate
from lmforge.tracking.session import Expected, Session, Unavailable, open_session

log = logging.getLogger("lmforge.tracking")

PARENT_TAG = "mlflow.parentRunId"
KFP_RUN_ID = "kfp.pipeline_run_id"
KFP_RUN_URL = "kfp.pipeline_run_url"
KFP_TASK_NAME = "kfp.task_name"
RUN_TYPE = "lmforge.run_type"
STAGE_TAG = "lmforge.stage"
PRESET_TAG = "lmforge.preset"
PARENT_SETTLE_S = 1.0  # how long a new parent run may take to become visible to a racing stage
ERROR_TAG = "lmforge.error"
HISTORY_FILE = "training_history.json"  # lmforge.model.build.HISTORY_FILE (not imported: it pulls in torch)
# The small files stages write next to their outputs that are worth seeing in MLflow (never weights or data).
SMALL_FILES = (
    "manifest.json",
    "report.html",
    "report.md",
    "results.json",
    "stats.json",
    "index.json",
    HISTORY_FILE,
    "status.json",
    "build_record.json",
)
# Per-step series of training_history.json: metric name -> (step list, value list).
SERIES = {
    "train_loss": ("step", "train_loss"),
    "lr": ("step", "lr"),
    "grad_norm": ("step", "grad_norm"),
    "tokens_per_sec": ("step", "tokens_per_sec"),
    "mfu": ("step", "mfu"),
    "memory_gb": ("step", "memory_gb"),
    "eval_loss": ("eval_step", "eval_loss"),
}
_RUN_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,249}$")
_KEY_BAD = re.compile(r"[^A-Za-z0-9_\-./ ]")
_BATCH_PARAMS = 100  # MLflow's per-request limits (log-batch)
_BATCH_METRICS = 1000


@dataclass(frozen=True)
class PipelineRun:
    """The pipeline run a stage belongs to: its correlation key and what the parent MLflow run is tagged with.

    Attributes:
        run_id: the KFP run id (``dsl.PIPELINE_JOB_ID_PLACEHOLDER``; a kfp.local run's id locally).
        pipeline_version: the pipeline's version (KFP pipeline version id, or lmforge's image tag).
        preset: the config preset of the run.
        run_url: the run's page in the KFP UI.
        name: the parent run's name; default ``lmforge-<run_id>``.
    """

    run_id: str
    pipeline_version: str | None = None
    preset: str | None = None
    run_url: str | None = None
    name: str | None = None

    def tags(self) -> dict[str, str]:
        """Tags of the parent run."""
        tags = {KFP_RUN_ID: self.run_id, RUN_TYPE: "pipeline", "lmforge.version": __version__}
        extra = {
            KFP_RUN_URL: self.run_url,
            "lmforge.pipeline_version": self.pipeline_version,
            PRESET_TAG: self.preset,
        }
        return tags | {k: v for k, v in extra.items() if v}


class StageLog(TypedDict, total=False):
    """What a stage's run logs besides its config and result (every key optional).

    Attributes:
        outputs: the stage's output directories by artifact name; their small files are uploaded, and a
            ``training_history.json`` in one of them gives the per-step metrics.
        history: the training history, when not in ``outputs``.
        task: the KFP task name (``kfp.task_name``; default the stage name).
    """

    outputs: Mapping[str, str | Path] | None
    history: Mapping[str, Any] | None
    task: str | None


@dataclass
class TrackedStage:
    """A stage's MLflow run while the stage runs; set :attr:`result` before the ``with`` block ends."""

    stage: str
    run_id: str | None = None
    parent_id: str | None = None
    owned: bool = True  # False: KFP made the run (MLFLOW_RUN_ID) and closes it
    result: StageResult | None = None


class Tracker:
    """Logs stages of pipeline runs to MLflow; every method is a no-op when tracking is off or has failed.

    One tracker per process is enough; it remembers the parent run ids it found and, once a call has failed
    after its retries, stays silent (one warning in all).
    """

    def __init__(
        self,
        cfg: TrackingConfig | None = None,
        *,
        tracking_uri: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.cfg = cfg or TrackingConfig()
        self.session: Session | None = open_session(self.cfg, tracking_uri_override=tracking_uri, env=env)
        self.scrub = self.session.scrub if self.session else Scrubber(env={})
        self._parents: dict[str, str] = {}

    @property
    def enabled(self) -> bool:
        """True when tracking is configured for this process and has not failed."""
        return self.session is not None and self.session.broken is None

    def pipeline_run_id(self, run: PipelineRun, *, create: bool = True) -> str | None:
        """The parent MLflow run of ``run`` (created if no stage made it yet, unless not ``create``).

        ``None`` when tracking is off or failed, or when there is none and ``create`` is false.
        """
        if self.session is None:
            return None
        try:
            return self._parent(self.session, run, create=create)
        except Unavailable:
            return None

    def track_stage(
        self, stage: str, cfg: Any, result: StageResult, *, run: PipelineRun, **logged: Unpack[StageLog]
    ) -> str | None:
        """Log a finished stage: one call after the stage's ``run`` returns. Returns its MLflow run id or ``None``.

        Args:
            stage: the stage name (``pretrain``, ``evaluate``, ...).
            cfg: the stage's resolved config (a pydantic model or a mapping), logged as params.
            result: what the stage's ``run`` returned.
            run: the pipeline run the stage belongs to.
            logged: what else the run logs (:class:`StageLog`).
        """
        with self.stage_run(stage, cfg, run=run, **logged) as tracked:
            tracked.result = result
        return tracked.run_id

    @contextlib.contextmanager
    def stage_run(
        self,
        stage: str,
        cfg: Any,
        *,
        run: PipelineRun,
        outputs: Mapping[str, str | Path] | None = None,
        history: Mapping[str, Any] | None = None,
        task: str | None = None,
    ) -> Iterator[TrackedStage]:
        """The stage's MLflow run for the duration of the block (RUNNING in the UI meanwhile).

        On a normal exit the block's ``tracked.result`` is logged and the run is FINISHED; on an exception the
        run is FAILED with the error as a tag, and the exception propagates unchanged.
        """
        tracked = self._start(stage, run, task)
        try:
            yield tracked
        except BaseException as exc:
            self._end(tracked, "KILLED" if isinstance(exc, KeyboardInterrupt | SystemExit) else "FAILED", exc)
            raise
        if tracked.result is not None:
            self._log(tracked, cfg, tracked.result, outputs or {}, history)
        self._end(tracked, "FINISHED", None)

    def end_pipeline_run(self, run: PipelineRun, *, status: str = "FINISHED") -> None:
        """Mark the parent run ended (``FINISHED`` / ``FAILED``); KFP's own integration does this for its parents."""
        session = self.session
        if session is None:
            return
        with contextlib.suppress(Unavailable):
            parent = self._parent(session, run)
            session.call("end the pipeline run", lambda c: c.set_terminated(parent, status))

    def _parent(self, session: Session, run: PipelineRun, *, create: bool = True) -> str | None:
        if run.run_id in self._parents:
            return self._parents[run.run_id]
        if not _RUN_KEY.match(run.run_id):
            session.give_up(f"pipeline run id {run.run_id!r} is not usable as a search key (letters, digits, ._:@/-)")
        experiment = session.experiment_id()
        found = self._find_parents(session, run.run_id)
        if not found and not create:
            return None
        created = None
        if not found:
            name = run.name or f"lmforge-{run.run_id}"
            created = session.call(
                "create the pipeline run",
                lambda c: c.create_run(experiment, run_name=name, tags=self._tags(run.tags())),
            ).info.run_id
            found = self._find_parents(session, run.run_id) or [(created, _now_ms())]
        if found[0][1] > _now_ms() - PARENT_SETTLE_S * 1000:
            # Stages racing to create the parent converge on the oldest (start time, then id). A start time is its
            # creator's clock, so a racer's older run can become visible after this search: look again once.
            time.sleep(PARENT_SETTLE_S)
            found = self._find_parents(session, run.run_id) or found
        parent = found[0][0]
        if created is not None and created != parent:
            log.info("pipeline run %s already had MLflow run %s; deleting the duplicate", run.run_id, parent)
            with contextlib.suppress(Expected):
                session.call(
                    "delete a duplicate pipeline run",
                    lambda c: c.delete_run(created),
                    expected=("RESOURCE_DOES_NOT_EXIST",),
                )
        self._parents[run.run_id] = parent
        return parent

    @staticmethod
    def _find_parents(session: Session, key: str) -> list[tuple[str, int]]:
        """Top-level runs tagged with ``key`` as (run id, start time in ms), oldest first (start time, then id)."""
        found = session.search_runs("find the pipeline run", f"tags.`{KFP_RUN_ID}` = '{key}'", max_results=100)
        tops = [(r.info.run_id, r.info.start_time or 0) for r in found if PARENT_TAG not in r.data.tags]
        return sorted(tops, key=lambda top: (top[1], top[0]))

    def _start(self, stage: str, run: PipelineRun, task: str | None) -> TrackedStage:
        session = self.session
        tracked = TrackedStage(stage)
        if session is None:
            return tracked
        tags = {STAGE_TAG: stage, KFP_TASK_NAME: task or stage, KFP_RUN_ID: run.run_id, RUN_TYPE: "stage"}
        try:
            if given := session.env.get("MLFLOW_RUN_ID"):  # KFP's MLflow integration made the task's run
                existing = session.call("get the task's run", lambda c: c.get_run(given))
                tracked.run_id, tracked.parent_id, tracked.owned = given, existing.data.tags.get(PARENT_TAG), False
                self._log_batch(session, given, tags=self._tags({STAGE_TAG: stage, RUN_TYPE: "stage"}))
                return tracked
            parent = self._parent(session, run)
            experiment = session.experiment_id()
            created = session.call(
                f"create the {stage} run",
                lambda c: c.create_run(
                    experiment, run_name=task or stage, tags=self._tags({**tags, PARENT_TAG: parent})
                ),
            )
            tracked.run_id, tracked.parent_id = created.info.run_id, parent
        except Unavailable:
            tracked.run_id = None
        return tracked

    def _end(self, tracked: TrackedStage, status: str, exc: BaseException | None) -> None:
        session = self.session
        if session is None or tracked.run_id is None:
            return
        run_id = tracked.run_id
        with contextlib.suppress(Unavailable):
            if exc is not None:
                error = self._tags({ERROR_TAG: f"{type(exc).__name__}: {exc}"})
                self._log_batch(session, run_id, tags=error)
            if tracked.owned:
                session.call(f"end the {tracked.stage} run", lambda c: c.set_terminated(run_id, status))

    def _log(
        self,
        tracked: TrackedStage,
        cfg: Any,
        result: StageResult,
        outputs: Mapping[str, str | Path],
        history: Mapping[str, Any] | None,
    ) -> None:
        session = self.session
        if session is None or tracked.run_id is None:
            return
        run_id = tracked.run_id
        dirs = {name: Path(p) for name, p in outputs.items() if not str(p).startswith("s3://") and Path(p).exists()}
        history = history if history is not None else _history_in(dirs.values())
        now = int(time.time() * 1000)
        series = _series_metrics(history, now) if history else []
        finals = _final_metrics(result)
        named = {m.key for m in series}
        child_finals = {(f"{k}_final" if k in named else k): v for k, v in finals.items()}
        try:
            self._log_batch(session, run_id, params=self._params(cfg))
            self._log_batch(session, run_id, metrics=series + _metrics(child_finals, now))
            self._log_batch(session, run_id, tags=self._tags(_summary_tags(result)))
            if tracked.parent_id:
                prefixed = {f"{tracked.stage}.{k}": v for k, v in finals.items()}
                self._log_batch(session, tracked.parent_id, metrics=_metrics(prefixed, now))
            if self.cfg.log_artifacts:
                self._upload(session, run_id, dirs, result)
        except Unavailable:
            return
        log.info("logged %s to MLflow run %s at %s", tracked.stage, run_id, session.display_uri)

    def _params(self, cfg: Any) -> dict[str, str]:
        data = cfg.model_dump(mode="json") if hasattr(cfg, "model_dump") else dict(cfg or {})
        flat = {_key(key): value for key, value in flatten(data).items()}
        return self.scrub.mapping(flat, limit=self.cfg.max_param_chars)

    def _tags(self, tags: Mapping[str, Any]) -> dict[str, str]:
        return self.scrub.mapping({_key(k): v for k, v in tags.items()}, limit=self.cfg.max_param_chars)

    @staticmethod
    def _log_batch(
        session: Session,
        run_id: str,
        *,
        params: Mapping[str, str] | None = None,
        metrics: list[Any] | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        """``log_batch`` in chunks within MLflow's per-request limits."""
        from mlflow.entities import Param, RunTag

        param_list = [Param(k, v) for k, v in (params or {}).items()]
        tag_list = [RunTag(k, v) for k, v in (tags or {}).items()]
        for i in range(0, len(param_list), _BATCH_PARAMS):
            chunk = param_list[i : i + _BATCH_PARAMS]
            session.call("log params", lambda c, chunk=chunk: c.log_batch(run_id, params=chunk))
        for i in range(0, len(tag_list), _BATCH_PARAMS):
            chunk = tag_list[i : i + _BATCH_PARAMS]
            session.call("set tags", lambda c, chunk=chunk: c.log_batch(run_id, tags=chunk))
        metric_list = metrics or []
        for i in range(0, len(metric_list), _BATCH_METRICS):
            chunk = metric_list[i : i + _BATCH_METRICS]
            session.call("log metrics", lambda c, chunk=chunk: c.log_batch(run_id, metrics=chunk))

    def _upload(self, session: Session, run_id: str, dirs: Mapping[str, Path], result: StageResult) -> None:
        """Upload each output's small files (under the output's name) and the stage's report (scrubbed copies)."""
        with tempfile.TemporaryDirectory(prefix="lmforge-mlflow-") as tmp:
            reports = 0
            for name, folder in dirs.items():
                for file in self._small_files(folder):
                    reports += file.name == "report.html"
                    try:
                        upload = self._scrubbed(file, Path(tmp))
                    except OSError as exc:
                        log.warning("%s: not uploaded to MLflow: %s", file, exc)
                        continue
                    session.call(
                        f"upload {name}/{file.name}",
                        lambda c, upload=upload, name=name: c.log_artifact(run_id, str(upload), artifact_path=name),
                    )
            if result.html and not reports:
                report = Path(tmp, uuid.uuid4().hex, "report.html")
                report.parent.mkdir()
                report.write_text(self.scrub.text(result.html), encoding="utf-8")
                session.call("upload report.html", lambda c: c.log_artifact(run_id, str(report)))

    def _small_files(self, path: Path) -> list[Path]:
        candidates = [path] if path.is_file() else [path / name for name in SMALL_FILES]
        files = [p for p in candidates if p.is_file() and p.stat().st_size <= self.cfg.max_artifact_bytes]
        return files if path.is_dir() else [p for p in files if p.name in SMALL_FILES]

    def _scrubbed(self, file: Path, tmp: Path) -> Path:
        """``file`` itself when no secret is in it, else a scrubbed copy of the same name under ``tmp``.

        Bytes that are not UTF-8 (a log with a stray Latin-1 byte) are kept as they are, and the text around
        them is scrubbed all the same.
        """
        text = file.read_bytes().decode("utf-8", errors="surrogateescape")
        clean = self.scrub.text(text)
        if clean == text:
            return file
        copy = tmp / uuid.uuid4().hex / file.name
        copy.parent.mkdir()
        copy.write_bytes(clean.encode("utf-8", errors="surrogateescape"))
        return copy


def _history_in(dirs: Iterable[Path]) -> dict[str, Any] | None:
    for folder in dirs:
        path = folder / HISTORY_FILE
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                log.warning("%s: not valid JSON (%s); no per-step metrics logged", path, exc)
                return None
            return data if isinstance(data, dict) else None
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    return float(value) if isinstance(value, int | float) else None


def _key(key: str) -> str:
    """A param/metric key MLflow accepts (letters, digits, ``_-./`` and space; at most 250 chars)."""
    return _KEY_BAD.sub("_", key)[:250]


def _metrics(values: Mapping[str, float], timestamp: int, step: int = 0) -> list[Any]:
    from mlflow.entities import Metric

    return [Metric(_key(k), v, timestamp, step) for k, v in values.items()]


def _series_metrics(history: Mapping[str, Any], now: int) -> list[Any]:
    """Every per-step value of the history, at its step; timestamps spread by ``elapsed_s`` when recorded."""
    from mlflow.entities import Metric

    steps = history.get("step") or []
    elapsed = history.get("elapsed_s") or []
    start = now - int(1000 * elapsed[-1]) if elapsed and len(elapsed) == len(steps) else now
    at_step = {int(s): start + int(1000 * e) for s, e in zip(steps, elapsed, strict=False)}
    metrics = []
    for name, (step_key, value_key) in SERIES.items():
        for step, value in zip(history.get(step_key) or [], history.get(value_key) or [], strict=False):
            number = _number(value)
            if number is not None:
                metrics.append(Metric(name, number, at_step.get(int(step), now), int(step)))
    return metrics


def _final_metrics(result: StageResult) -> dict[str, float]:
    """``result.metrics`` (numbers only) plus the gate's checks when the summary holds them."""
    finals = {k: n for k, v in result.metrics.items() if (n := _number(v)) is not None}
    for check in result.summary.get("checks") or []:
        if isinstance(check, Mapping) and "name" in check and "passed" in check:
            finals[f"gate.{check['name']}.passed"] = 1.0 if check["passed"] else 0.0
            value = _number(check.get("value"))
            if value is not None and math.isfinite(value):
                finals[f"gate.{check['name']}.value"] = value
    return finals


def _summary_tags(result: StageResult) -> dict[str, str]:
    """Scalar facts of the summary as ``summary.<key>`` tags, and each gate check's reason as ``gate.<check>``."""
    tags: dict[str, str] = {}
    for key, value in result.summary.items():
        if isinstance(value, str | int | float | bool) or value is None:
            tags[f"summary.{key}"] = value if isinstance(value, str) else json.dumps(value)
    for check in result.summary.get("checks") or []:
        if isinstance(check, Mapping) and "name" in check:
            verdict = check_mark(check)
            tags[f"gate.{check['name']}"] = truncate(f"{verdict}: {check.get('reason', '')}", 5000)
    return tags


def _now_ms() -> int:
    return int(time.time() * 1000)
