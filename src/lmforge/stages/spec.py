"""What a stage declares: its named artifacts and parameters, its config section, runtime and entry point.

A :class:`StageSpec` is the one statement of a stage's contract. The KFP component's signature, the
component README, the image a step runs in, whether the launcher may run it distributed, ``lmforge
stage NAME`` (its arguments, ``--help`` and error messages) and the compile tests are all read from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib import import_module
from typing import Any, Literal

from lmforge.config.base import StrictModel
from lmforge.results import StageResult

ArtifactKind = Literal["Dataset", "Model", "Artifact"]
ParamKind = Literal["str", "int", "bool", "dict", "list", "list[int]"]
ARTIFACT_KINDS: tuple[str, ...] = ("Dataset", "Model", "Artifact")
# Runtime image (images/<runtime>/Dockerfile) → whether its steps belong on the GPU node pool.
RUNTIMES: dict[str, bool] = {"cpu": False, "train": True, "tensorrt": True}


@dataclass(frozen=True)
class Port:
    """One named artifact or parameter of a stage.

    Attributes:
        name: the name everywhere: entry-point keyword, KFP input/output, ``lmforge stage --io NAME=...``.
        kind: ``Dataset``/``Model``/``Artifact`` for an artifact (a directory), else the parameter type.
        description: one line for people (component README, Kubeflow UI, ``lmforge stage NAME --help``).
        required: an input the stage cannot run without; optional ones may be left out.
        default: the value an optional parameter takes (artifacts: always ``None``).
        many: an artifact input that is a list of artifacts (collected from a fan-out).
    """

    name: str
    kind: str
    description: str
    required: bool = True
    default: Any = None
    many: bool = False

    @property
    def is_artifact(self) -> bool:
        """Whether this port is a directory artifact rather than a parameter."""
        return self.kind in ARTIFACT_KINDS


def artifact(name: str, kind: ArtifactKind, description: str, *, required: bool = True, many: bool = False) -> Port:
    """An artifact input or output (a directory with a ``manifest.json``)."""
    return Port(name, kind, description, required=required, many=many)


def param(name: str, kind: ParamKind, description: str, *, default: Any = None, required: bool | None = None) -> Port:
    """A parameter; required unless a default is given."""
    return Port(name, kind, description, required=default is None if required is None else required, default=default)


@dataclass(frozen=True)
class StageSpec:
    """One step of the DAG.

    Attributes:
        name: stage name (component folder, KFP task, ``lmforge stage NAME``).
        summary: one sentence saying what the stage does.
        entry: ``module:function`` of the entry point, called as ``function(cfg, *, <ports by name>)`` (or
            ``function(*, <ports>)`` for a stage without config); it returns a :class:`StageResult`.
        config: the stage's config model (``None``: the stage has no settings).
        section: the preset section the config comes from (fan-out steps share ``clean``'s).
        inputs: artifact inputs and input parameters, in signature order.
        outputs: artifact outputs.
        returns: output parameters; the entry point puts each in ``StageResult.summary`` under its name.
        cache_keys: parameters passed only so that KFP's cache key changes with them (content fingerprints
            from ``preflight``); recorded on every output artifact's metadata, never passed to the entry.
        html: name of the KFP ``HTML`` output that receives ``StageResult.html`` (``None``: none).
        markdown: name of the KFP ``Markdown`` output that receives ``StageResult.markdown``.
        runtime: the image it runs in (:data:`RUNTIMES`).
        distributed: the entry point joins torchrun's process group (``lmforge.train.distributed``), so the
            launcher may run it under torchrun or as a multi-node job.
        headline: the figures (metric or summary names) a person sees in the stage's one line of a local run.
        context: facts about the run (not artifacts, not part of the cache key) the entry point also takes by
            keyword: ``preset`` (the run's preset) and ``run_id`` (``$LMFORGE_RUN_ID``), for its report.
    """

    name: str
    summary: str
    entry: str
    config: type[StrictModel] | None
    section: str | None = None
    inputs: tuple[Port, ...] = ()
    outputs: tuple[Port, ...] = ()
    returns: tuple[Port, ...] = ()
    cache_keys: tuple[Port, ...] = ()
    html: str | None = None
    markdown: str | None = None
    runtime: str = "cpu"
    distributed: bool = False
    context: tuple[str, ...] = ()
    headline: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.runtime not in RUNTIMES:
            raise ValueError(f"stage {self.name}: unknown runtime {self.runtime!r}; runtimes: {', '.join(RUNTIMES)}")
        if self.config is not None and self.section is None:
            object.__setattr__(self, "section", self.name)
        names = [p.name for p in self.ports]
        if len(set(names)) != len(names):
            raise ValueError(f"stage {self.name}: a port name occurs twice in {names}")

    @property
    def ports(self) -> tuple[Port, ...]:
        """Every port the entry point takes (inputs and outputs), in signature order."""
        return (*self.inputs, *self.outputs)

    @property
    def on_gpu(self) -> bool:
        """Whether the stage's steps belong on the GPU node pool."""
        return RUNTIMES[self.runtime]

    def port(self, name: str) -> Port:
        """The port called ``name`` (inputs, outputs, returns or cache keys)."""
        for port in (*self.ports, *self.returns, *self.cache_keys):
            if port.name == name:
                return port
        raise KeyError(name)

    def function(self) -> Callable[..., StageResult]:
        """The entry point, imported on first use (stage modules import torch, onnx, ...)."""
        return _entry_point(self.entry)


@cache
def _entry_point(entry: str) -> Callable[..., StageResult]:
    module, _, attr = entry.partition(":")
    return getattr(import_module(module), attr)
