"""What every lmforge component runs inside its container: its registry entry, called with KFP's artifacts.

A component's body is one line, ``return run_component("<stage>", locals())``: its signature (generated
from the registry, :mod:`lmforge_kfp.components.signature`) names the artifacts and parameters, and this
function maps them to the stage's entry point — artifacts to their local ``path``, ``preset``/``overrides``
to the stage's config, the launch parameters of a distributed stage (``LAUNCH_PORTS`` there) to
:func:`lmforge.launch.run_training_stage` — then writes the stage's ``Metrics``/``HTML``/``Markdown``
outputs and returns its output parameters.

The stage's context is the run's ``preset``, the KFP run id (``$LMFORGE_RUN_ID``, from the pod label) and the
pipeline version (the content tag of the code the step runs, also exported as ``$LMFORGE_PIPELINE_VERSION`` for
the processes the step starts, such as torchrun's workers): what the stage's MLflow run is tagged with when
tracking is on. A training step's ``run_root`` becomes ``$LMFORGE_RUN_ROOT``: with the run id, it places a
templated ``checkpoint.dir``.
"""

from __future__ import annotations

import collections
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from lmforge.component_io import publish, setup_logging
from lmforge.exit_codes import exit_on_input_error
from lmforge.run_context import RunContext
from lmforge.stages import get_stage, resolve_stage_config, run_stage
from lmforge.stages.spec import StageSpec

log = logging.getLogger("lmforge.stage")
METRICS = "metrics"  # the Output[Metrics] every component has


def run_component(stage: str, args: Mapping[str, Any]) -> Any:
    """Run registry stage ``stage`` with a component's arguments (its ``locals()``) and return its outputs.

    An input or config error ends the step with one ``error:`` line and exit code 2 (:mod:`lmforge.exit_codes`).

    Returns:
        Nothing, the one output parameter, or a named tuple of them (``StageSpec.returns``), read from the
        stage result's summary.
    """
    setup_logging()
    with exit_on_input_error():
        return _run(stage, args)


def _run(stage: str, args: Mapping[str, Any]) -> Any:
    spec = get_stage(stage)
    for key in spec.cache_keys:  # the fingerprint is in the cache key already; record it for people too
        for port in spec.outputs:
            args[port.name].metadata[key.name] = args[key.name]
    io = {
        port.name: _local(args[port.name]) if port.is_artifact else args[port.name]
        for port in spec.ports
        if args.get(port.name) is not None
    }
    context = _context(args)
    if spec.distributed:
        result = _run_distributed(spec, args, io, context)
    else:
        cfg = resolve_stage_config(stage, args["preset"], args["overrides"]) if spec.config else None
        result = run_stage(stage, cfg, io, context=context)
    publish(
        result,
        metrics=args[METRICS],
        html=args[spec.html] if spec.html else None,
        markdown=args[spec.markdown] if spec.markdown else None,
        markdown_text=result.markdown,
    )
    log.info("done %s", json.dumps({"stage": stage, "headline": headline(spec, result)}))
    values = [result.summary[port.name] for port in spec.returns]
    if len(values) <= 1:
        return values[0] if values else None
    return collections.namedtuple("Outputs", [port.name for port in spec.returns])(*values)


def headline(spec: StageSpec, result: Any) -> list[str]:
    """``["val_loss 5.12", ...]``: the stage's headline figures (``StageSpec.headline``) it reported."""
    figures = []
    for name in spec.headline:
        value = result.metrics.get(name, result.summary.get(name))
        if isinstance(value, float):
            figures.append(f"{name} {value:.4g}")
        elif value is not None:
            figures.append(f"{name} {value}")
    return figures


def _context(args: Mapping[str, Any]) -> dict[str, str]:
    """The run's facts a stage may take (``StageSpec.context``) and its MLflow run is tagged with."""
    return _export_run_context(args).stage_context(args.get("preset", ""))


def _export_run_context(args: Mapping[str, Any]) -> RunContext:
    """The step's run context, also exported to its environment for the processes it starts (torchrun's workers).

    The pipeline version defaults to the content tag of this code; a training step's ``run_root`` parameter,
    when set, is the run root ({run_root} of a templated checkpoint.dir, here, in torchrun's workers and a
    job's pods).
    """
    from lmforge_kfp.components.images import content_tag

    run = RunContext.from_env()
    run = replace(
        run,
        pipeline_version=run.pipeline_version or content_tag(),
        run_root=args.get("run_root") or run.run_root,
    )
    os.environ.update(run.to_env())
    return run


def _local(value: Any) -> Any:
    """An artifact's local path (a list of them for a collected fan-out)."""
    if isinstance(value, list):
        return [item.path for item in value]
    return value.path


def _run_distributed(spec: StageSpec, args: Mapping[str, Any], io: dict[str, Any], context: dict[str, str]) -> Any:
    from lmforge.launch import parse_launch, run_training_stage
    from lmforge_kfp.components.images import image_for

    return run_training_stage(
        spec.name,
        parse_launch(args["launch"], gpus_per_node=args["gpu_count"]),
        io,
        preset=args["preset"],
        overrides=args["overrides"],
        image=args["job_image"] or image_for(spec.name),
        staging_uri=args["staging_uri"],
        context=context,
    )
