"""Every stage's MLflow run, opened by :func:`lmforge.stages.run_stage` around the stage's entry point.

When tracking is on (a tracking URI: ``MLFLOW_TRACKING_URI`` from the pipeline's Secret, KFP's own MLflow
integration or the caller's environment), a stage gets a nested run under its pipeline run's parent: RUNNING
while the entry point runs, FAILED with the error when it raises. Its params are the resolved config and the
stage's parameter inputs (``input.<name>``: the corpus URI, a shard index, ...), its metrics and files what
:class:`~lmforge.tracking.Tracker` logs from the result and the output directories.

The pipeline run is the context's ``run_id`` (the KFP run id, ``$LMFORGE_RUN_ID``), tagged with the context's
``preset`` and ``pipeline_version`` (the image tag, or ``$LMFORGE_PIPELINE_VERSION`` that the KFP runtime sets
for the processes it starts); a stage run by hand without a run id gets a pipeline run of its own. The parent
run ends with the DAG's last step: ``promote``, or the gate's stage when its gate fails (promote does not run
then); a stage that fails marks it FAILED (a retry that succeeds and reaches the end marks it FINISHED again).

With tracking off, :func:`tracked_stage` costs one environment lookup and imports nothing from MLflow.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from lmforge.results import StageResult
from lmforge.run_context import RunContext
from lmforge.stages.spec import StageSpec
from lmforge.tracking.runs import PipelineRun, TrackedStage, Tracker
from lmforge.tracking.session import tracking_uri

FINAL_STAGE = "promote"  # the DAG's last step when the gate passes
GATE_OUTPUT = "passed"  # the output parameter under which a gate stage says whether promote runs
INPUT_PREFIX = "input."


@contextlib.contextmanager
def tracked_stage(
    spec: StageSpec, cfg: Any, kwargs: Mapping[str, Any], context: Mapping[str, str] | None = None
) -> Iterator[TrackedStage]:
    """The stage's MLflow run for the duration of the block; set ``tracked.result`` to the stage's result in it.

    Args:
        spec: the stage.
        cfg: its resolved config (``None`` for a stage without one).
        kwargs: the entry point's keyword arguments (ports by name; artifact values are local paths).
        context: the run's ``run_id``, ``preset`` and ``pipeline_version``.
    """
    if tracking_uri() is None:
        yield TrackedStage(spec.name)
        return
    context = context or {}
    tracker = Tracker()
    run = pipeline_run(context)
    outputs = {port.name: kwargs[port.name] for port in spec.outputs if kwargs.get(port.name)}
    try:
        with tracker.stage_run(spec.name, stage_params(spec, cfg, kwargs), run=run, outputs=outputs) as tracked:
            yield tracked
    except BaseException as exc:
        status = "KILLED" if isinstance(exc, KeyboardInterrupt | SystemExit) else "FAILED"
        tracker.end_pipeline_run(run, status=status)
        raise
    if ends_pipeline(spec, tracked.result):
        tracker.end_pipeline_run(run)


def pipeline_run(context: Mapping[str, str], run: RunContext | None = None) -> PipelineRun:
    """The pipeline run a stage belongs to, from its context (a run of its own when the context has no run id).

    The pipeline version not in ``context`` comes from ``run`` (default: this process's environment's).
    """
    run_id = context.get("run_id") or f"stage-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"
    version = context.get("pipeline_version") or (run or RunContext.from_env()).pipeline_version or None
    return PipelineRun(run_id, pipeline_version=version, preset=context.get("preset") or None)


def stage_params(spec: StageSpec, cfg: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """What a stage's run gets as params: its config's fields and its parameter inputs as ``input.<name>``."""
    params: dict[str, Any] = dict(cfg.model_dump(mode="json")) if hasattr(cfg, "model_dump") else dict(cfg or {})
    for port in spec.inputs:
        if not port.is_artifact and port.name in kwargs:
            params[f"{INPUT_PREFIX}{port.name}"] = kwargs[port.name]
    return params


def ends_pipeline(spec: StageSpec, result: StageResult | None) -> bool:
    """Whether the stage that produced ``result`` is the last step of its pipeline run."""
    if result is None:
        return False
    if spec.name == FINAL_STAGE:
        return True
    gate = any(port.name == GATE_OUTPUT for port in spec.returns)
    return gate and result.summary.get(GATE_OUTPUT) is False
