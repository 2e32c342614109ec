"""The stage registry: every step of the DAG declared once, and the one way to call a stage.

- :mod:`lmforge.stages.spec`: what a stage declares (:class:`StageSpec`, :class:`Port`).
- :mod:`lmforge.stages.registry`: every stage (:data:`STAGES`), :func:`get_stage`, :func:`register`.
- :mod:`lmforge.stages.runner`: :func:`run_stage` (arguments checked against the registry).
- :mod:`lmforge.stages.configs`: the pipeline config made from the stages' sections, presets, field help.
"""

from lmforge.stages.configs import (
    FieldHelp,
    PipelineConfig,
    explain,
    overrides_help,
    pipeline_config_model,
    render_config_markdown,
    resolve_config,
    resolve_stage_config,
    sections,
)
from lmforge.stages.registry import STAGES, get_stage, register, unregister
from lmforge.stages.runner import bind, run_stage
from lmforge.stages.spec import RUNTIMES, Port, StageSpec, artifact, param

__all__ = [
    "RUNTIMES",
    "STAGES",
    "FieldHelp",
    "PipelineConfig",
    "Port",
    "StageSpec",
    "artifact",
    "bind",
    "explain",
    "get_stage",
    "overrides_help",
    "param",
    "pipeline_config_model",
    "register",
    "render_config_markdown",
    "resolve_config",
    "resolve_stage_config",
    "run_stage",
    "sections",
    "unregister",
]
