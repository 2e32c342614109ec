"""Optional MLflow tracking and model registry: a parent run per pipeline run, a nested run per stage.

Tracking is on only when a tracking URI is configured (``TrackingConfig.tracking_uri`` or
``MLFLOW_TRACKING_URI``) and the process is rank 0; otherwise every call here returns at once, logs nothing
and imports nothing from MLflow. A tracking failure (server down, 401/403, timeouts) is retried a bounded
number of times, then reported once as a warning naming the tracking URI; it never raises into the stage.
Credentials never reach MLflow (:mod:`lmforge.tracking.redact`).

Every stage is tracked in one place: :func:`lmforge.stages.run_stage` (what KFP components and ``lmforge stage``
call) runs the entry point inside the stage's MLflow run (:mod:`~lmforge.tracking.stages`); :func:`track_stage`
logs a finished stage by hand::

    from lmforge.tracking import track_stage
    track_stage("pretrain", cfg, result, run_id=kfp_run_id, outputs={"model": model.path}, preset=preset)

* :mod:`~lmforge.tracking.stages` — the MLflow run around every stage run through the registry;
* :mod:`~lmforge.tracking.promotion` — what ``promote`` checks and registers;
* :mod:`~lmforge.tracking.runs` — :class:`Tracker`, parent/child runs, params, metrics, artifacts;
* :mod:`~lmforge.tracking.registry` — releases as model versions and the ``production`` alias;
* :mod:`~lmforge.tracking.compare` — the last runs side by side;
* :mod:`~lmforge.tracking.session` — on/off, retries, the one warning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Unpack

from lmforge.config.tracking import TrackingConfig
from lmforge.results import StageResult
from lmforge.tracking.compare import compare_runs
from lmforge.tracking.registry import Registration, production_baseline_from_registry, register_release
from lmforge.tracking.runs import PipelineRun, StageLog, TrackedStage, Tracker
from lmforge.tracking.session import tracking_uri

__all__ = [
    "PipelineRun",
    "Registration",
    "StageLog",
    "StageRunOptions",
    "TrackedStage",
    "Tracker",
    "TrackingConfig",
    "compare_runs",
    "production_baseline_from_registry",
    "register_release",
    "stage_run",
    "track_stage",
    "tracking_uri",
]


class StageRunOptions(StageLog, total=False):
    """Keywords of :func:`track_stage` and :func:`stage_run`: a :class:`StageLog`, the pipeline run's tags
    (:class:`PipelineRun`: ``preset``, ``pipeline_version``, ``run_url``) and the tracking settings
    (``tracking``; ``mlflow_tracking_uri`` overrides ``MLFLOW_TRACKING_URI``)."""

    preset: str | None
    pipeline_version: str | None
    run_url: str | None
    tracking: TrackingConfig | None
    mlflow_tracking_uri: str | None


def track_stage(
    stage: str, cfg: Any, result: StageResult, *, run_id: str, **options: Unpack[StageRunOptions]
) -> str | None:
    """Log a finished stage under the pipeline run ``run_id``; its MLflow run id, or ``None`` when off or failed.

    See :meth:`Tracker.track_stage`.
    """
    with stage_run(stage, cfg, run_id=run_id, **options) as tracked:
        tracked.result = result
    return tracked.run_id


@contextlib.contextmanager
def stage_run(stage: str, cfg: Any, *, run_id: str, **options: Unpack[StageRunOptions]) -> Iterator[TrackedStage]:
    """Context-manager form of :func:`track_stage`: the stage's run is RUNNING during the block; set
    ``tracked.result`` inside it. An exception marks the run FAILED and propagates."""
    tracker = Tracker(options.pop("tracking", None), tracking_uri=options.pop("mlflow_tracking_uri", None))
    run = PipelineRun(
        run_id,
        pipeline_version=options.pop("pipeline_version", None),
        preset=options.pop("preset", None),
        run_url=options.pop("run_url", None),
    )
    with tracker.stage_run(stage, cfg, run=run, **options) as tracked:  # what is left is the StageLog
        yield tracked
