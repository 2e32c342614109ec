"""A component's signature and docstring, derived from its stage's registry entry.

:func:`documented` gives a component function its docstring (purpose, one line per argument, returns)
from the registry, so the descriptions KFP shows in the UI and the generated READMEs are the registry's.
:func:`expected_parameters` is the component's signature: every component's source is written from it
(:mod:`lmforge_kfp.components.source`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from lmforge.stages import explain, get_stage
from lmforge.stages.spec import Port, StageSpec, param

F = TypeVar("F", bound=Callable[..., Any])

METRICS_HELP = "Scalar figures of the stage, shown by the Kubeflow UI."
HTML_HELP = "Self-contained HTML report of the stage."
MARKDOWN_HELP = "Markdown summary for the Kubeflow UI."
# The ports every component of a stage with a config section takes after its own, and those a distributed
# stage's takes after them: what lmforge_kfp.runtime hands to the stage's config and to the launcher.
PRESET = param(
    "preset", "str", "lmforge preset the stage's config starts from (see `lmforge presets`).", default="tiny-cpu"
)
OVERRIDES = param("overrides", "str", "", default="{}")  # its description names the stage's section
LAUNCH_PORTS: tuple[Port, ...] = (
    param(
        "launch",
        "str",
        "JSON object of LaunchConfig fields: how wide this step trains. {} : one pod, gpu_count processes "
        '(torchrun --standalone when gpu_count > 1, else in this process); {"num_nodes": 4, "gpus_per_node": 8} '
        "submits a Kubeflow Trainer TrainJob (or PyTorchJob with backend pytorchjob) named after $LMFORGE_RUN_ID "
        "and waits for it (a retried step adopts it). See `lmforge config --explain launch`.",
        default="{}",
    ),
    param(
        "staging_uri",
        "str",
        "s3://bucket/prefix where a multi-node job's inputs and outputs are staged "
        "(<staging_uri>/<run id>/<task>/<name>); needed only with num_nodes > 1.",
        default="",
    ),
    param(
        "gpu_count",
        "int",
        "GPUs of this step's pod (the pipeline passes its gpu_count); the default of launch.gpus_per_node.",
        default=1,
    ),
    param(
        "job_image",
        "str",
        "Image of the job's pods (num_nodes > 1); empty: this package's image for the stage.",
        default="",
    ),
    param(
        "run_root",
        "str",
        "The run's root, $LMFORGE_RUN_ROOT of the training processes: a templated train.checkpoint.dir "
        "({run_root}/checkpoints/{run_id}/{stage}, the GPU presets') puts checkpoints under it; the pipeline passes "
        "preflight's run_root (staging_uri, else release_root). Empty: $LMFORGE_RUN_ROOT as it is.",
        default="",
    ),
)
NO_DEFAULT = object()


@dataclass(frozen=True)
class Parameter:
    """One parameter of a component function: name, what KFP makes of it, default, description."""

    name: str
    kind: str  # "input", "output" (artifacts), "param"
    type: str  # artifact kind, "Metrics"/"HTML"/"Markdown", or a parameter type
    default: Any
    description: str
    many: bool = False


def expected_parameters(spec: StageSpec) -> list[Parameter]:
    """The component function's parameters, in order: required inputs, outputs and reports, then optional ones."""

    required = [_as_parameter(port) for port in spec.inputs if port.required]
    outputs = [Parameter(port.name, "output", port.kind, NO_DEFAULT, port.description) for port in spec.outputs]
    outputs.append(Parameter("metrics", "output", "Metrics", NO_DEFAULT, METRICS_HELP))
    if spec.html:
        outputs.append(Parameter(spec.html, "output", "HTML", NO_DEFAULT, HTML_HELP))
    if spec.markdown:
        outputs.append(Parameter(spec.markdown, "output", "Markdown", NO_DEFAULT, MARKDOWN_HELP))
    optional = [_as_parameter(port) for port in (*spec.inputs, *spec.cache_keys) if not port.required]
    if spec.config is not None:
        optional += [_as_parameter(PRESET), _as_parameter(replace(OVERRIDES, description=overrides_description(spec)))]
    if spec.distributed:
        optional += [_as_parameter(port) for port in LAUNCH_PORTS]
    return [*required, *outputs, *optional]


def _as_parameter(port: Port) -> Parameter:
    """The component parameter of a registry port (an artifact input or a parameter)."""
    kind = "input" if port.is_artifact else "param"
    default = NO_DEFAULT if port.required else port.default
    return Parameter(port.name, kind, port.kind, default, port.description, port.many)


def overrides_description(spec: StageSpec) -> str:
    """Help of a stage's ``overrides`` parameter, with an example built from its first field."""
    first = explain(str(spec.section))[0]
    example = json.dumps({first.path.partition(".")[2]: json.loads(first.default)})
    return (
        f"JSON object of {spec.config.__name__ if spec.config else ''} fields overriding the preset's "
        f"{spec.section} section (dotted keys nest), e.g. {example}; every field: `lmforge config --explain "
        f"{spec.section}` or docs/config.md."
    )


def docstring(spec: StageSpec) -> str:
    """The component's docstring in Google style: summary, ``Args:`` and ``Returns:`` from the registry."""
    lines = [spec.summary, "", "Args:"]
    lines += [f"    {p.name}: {p.description}" for p in expected_parameters(spec)]
    if spec.returns:
        lines += ["", "Returns:"]
        lines += [f"    {port.name}: {port.description}" for port in spec.returns]
    return "\n".join(lines)


def documented(stage: str) -> Callable[[F], F]:
    """Decorator (under ``@dsl.component``) giving a component function its registry docstring."""

    def decorate(func: F) -> F:
        func.__doc__ = docstring(get_stage(stage))
        return func

    return decorate
