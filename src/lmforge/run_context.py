"""The facts about a pipeline run that travel by environment variable, and their names.

The KFP runtime (:mod:`lmforge_kfp.runtime`) exports them for the processes a step starts (torchrun's workers
inherit them); the launcher (:mod:`lmforge.launch`) passes the run id and root to a multi-node job's pods, which
inherit nothing; a templated ``checkpoint.dir`` is filled from them (:mod:`lmforge.train.checkpoint`) and a
stage's MLflow run is tagged with them (:mod:`lmforge.tracking.stages`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields

# The pipeline sets this from the step pod's `pipeline/runid` label (Downward API): the run id names a multi-node
# job (a retried step adopts it) and a templated checkpoint.dir without being a task input, which would change
# every run's cache key.
RUN_ID_ENV = "LMFORGE_RUN_ID"
# The run's root (staging root, else release root), which the GPU presets' templated checkpoint.dir names; the
# pipeline passes it to the training steps as their run_root parameter.
RUN_ROOT_ENV = "LMFORGE_RUN_ROOT"
# The content tag of the code a step runs, which tags the stage's MLflow run.
PIPELINE_VERSION_ENV = "LMFORGE_PIPELINE_VERSION"
# Set by a runner that runs each stage in its image (lmforge run --runner docker|podman): JSON
# {runtime: {"reference", "id", "digest"}}; the release manifest records, per stage, the image its runtime ran in.
IMAGES_ENV = "LMFORGE_IMAGES"


@dataclass(frozen=True)
class RunContext:
    """What a process knows about the pipeline run it belongs to; an empty string is a fact not known."""

    run_id: str = ""
    run_root: str = ""
    pipeline_version: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> RunContext:
        """The context ``environ`` carries; a variable that is unset counts as empty."""
        return cls(**{name: environ.get(variable, "") for name, variable in ENV_NAMES.items()})

    def to_env(self) -> dict[str, str]:
        """The environment variables that carry this context, the empty facts left out."""
        return {ENV_NAMES[f.name]: value for f in fields(self) if (value := getattr(self, f.name))}

    def stage_context(self, preset: str) -> dict[str, str]:
        """What :func:`lmforge.stages.run_stage` takes as ``context``: the run's preset, run id and version."""
        return {"preset": preset, "run_id": self.run_id, "pipeline_version": self.pipeline_version}


ENV_NAMES = {"run_id": RUN_ID_ENV, "run_root": RUN_ROOT_ENV, "pipeline_version": PIPELINE_VERSION_ENV}
"""The environment variable of each :class:`RunContext` field."""


@contextlib.contextmanager
def environ_set(settings: Mapping[str, str]) -> Iterator[None]:
    """Set ``settings`` in this process's environment for the block, then restore what was there (unset stays
    unset). Not for threads that read the environment meanwhile."""
    previous = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
