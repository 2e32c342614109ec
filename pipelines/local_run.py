"""Run the compiled lmforge DAG on this machine with ``kfp.local`` (what ``lmforge run`` does)."""

from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kfp import local
from kfp.components import load_component_from_file

from lmforge.errors import LmforgeError
from lmforge.launch.stage_runner import RUN_ID_ENV

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class PipelineRunError(LmforgeError):
    """A task of the local run failed."""


COMPILED_PIPELINE = Path(__file__).resolve().parent / "compiled" / "lmforge_pipeline.yaml"


@dataclass(frozen=True)
class LocalRun:
    """Where a local run left its outputs."""

    run_dir: Path
    seconds: float

    def output(self, task: str, name: str) -> Path:
        """Path of output artifact ``name`` of ``task`` (e.g. ``evaluate``, ``evaluation``)."""
        return self.run_dir / task / name

    @property
    def promoted(self) -> bool:
        """Whether the ``promote`` task ran (the gate passed)."""
        return (self.run_dir / "promote").is_dir()


def new_run_id() -> str:
    """A run id unique on this machine and sortable by start time: ``YYYYMMDD-HHMMSS-<8 hex>``."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def _run_id_in_env(run_id: str) -> Iterator[None]:
    """``$LMFORGE_RUN_ID`` for the tasks (kfp.local passes no pod label): the run id the reports name."""
    previous = os.environ.get(RUN_ID_ENV)
    os.environ[RUN_ID_ENV] = run_id
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(RUN_ID_ENV, None)
        else:
            os.environ[RUN_ID_ENV] = previous


def run_pipeline_locally(
    params: dict[str, Any], pipeline_root: Path, pipeline_yaml: Path = COMPILED_PIPELINE
) -> LocalRun:
    """Run the compiled pipeline with ``SubprocessRunner(use_venv=False)``; raise if any task fails.

    Each call gets its own directory ``<pipeline_root>/<run id>/`` (:func:`new_run_id`), so two runs
    started on one ``--output`` never share, or mistake each other's, outputs.
    """
    run_id = new_run_id()
    pipeline_root = Path(pipeline_root).resolve() / run_id
    pipeline_root.mkdir(parents=True)  # never exist_ok: a run directory belongs to one run
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(pipeline_root), raise_on_error=True)
    start = time.perf_counter()
    with warnings.catch_warnings(), _run_id_in_env(run_id):
        # Resource, placement and image settings are for the cluster; kfp.local says so once per task.
        warnings.filterwarnings("ignore", message=".*have no effect in the current local runner.*")
        warnings.filterwarnings("ignore", message=".*custom or non-Python base image.*")
        try:
            load_component_from_file(str(pipeline_yaml))(**params)
        except RuntimeError as exc:  # kfp.local's way of saying a task failed
            message = _ANSI.sub("", str(exc))
            raise PipelineRunError(
                f"{message} The task's own error is in its log above; outputs: {pipeline_root}"
            ) from exc
    seconds = time.perf_counter() - start
    new = sorted(p for p in pipeline_root.iterdir() if p.is_dir())
    if len(new) != 1:
        raise RuntimeError(f"expected one new run directory under {pipeline_root}, found {[p.name for p in new]}")
    return LocalRun(new[0], seconds)
