"""Run the compiled lmforge DAG on this machine with ``kfp.local`` (what ``lmforge run`` does).

Each run gets ``<root>/<run id>/``: kfp.local's outputs in the pipeline's folder below it, the logs in ``logs/``
(``run.log`` and one file per task, see :mod:`lmforge_kfp.pipelines.console`) and the pipeline it ran. The
compiled pipeline's retry policies are dropped for a local run: a laptop has no preemption, and kfp.local would
rerun a deterministic failure after 30-60 s of backoff. In containers the tasks run the images of this code, named
by its content tag (what ``make local-images`` builds), not the release tag the committed pipeline pulls.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import yaml
from kfp import local
from kfp.components import load_component_from_file

from lmforge.errors import LmforgeError
from lmforge.run_context import RUN_ID_ENV, environ_set
from lmforge_kfp.components.images import content_tag, with_tag
from lmforge_kfp.containers import ContainerSettings, container_runner
from lmforge_kfp.pipelines.console import ANSI, RunConsole

COMPILED_PIPELINE = Path(__file__).resolve().parent / "compiled" / "lmforge_pipeline.yaml"
LOGS = "logs"


class PipelineRunError(LmforgeError):
    """A task of the local run failed; the message is the task's own error line (or the runner's) and its log."""

    def __init__(self, message: str, *, run_dir: Path, task: str | None, log: Path) -> None:
        super().__init__(message)
        self.run_dir = run_dir
        self.task = task
        self.log = log


@dataclass(frozen=True)
class LocalRun:
    """Where a local run left its outputs."""

    run_dir: Path
    seconds: float
    logs: Path

    def output(self, task: str, name: str) -> Path:
        """Path of output artifact ``name`` of ``task`` (e.g. ``evaluate``, ``evaluation``)."""
        return self.run_dir / task / name

    def parameter(self, task: str, name: str) -> Any:
        """Output parameter ``name`` of ``task`` (a single return value is ``Output``), as kfp.local recorded it."""
        executor_output = json.loads((self.run_dir / task / "executor_output.json").read_text(encoding="utf-8"))
        return executor_output["parameterValues"][name]

    @property
    def run_id(self) -> str:
        """The run id (the name of the run's directory, ``$LMFORGE_RUN_ID`` of its tasks)."""
        return self.logs.parent.name

    @property
    def promoted(self) -> bool:
        """Whether the ``promote`` task ran (the gate passed)."""
        return (self.run_dir / "promote").is_dir()


def new_run_id() -> str:
    """A run id unique on this machine and sortable by start time: ``YYYYMMDD-HHMMSS-<8 hex>``."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-{uuid.uuid4().hex[:8]}"


def local_pipeline(spec_text: str, runner: str) -> str:
    """The compiled pipeline as a local run with ``runner`` runs it (documents: pipeline spec, platform spec).

    Every task's ``retryPolicy`` is removed; in containers (``docker``, ``podman``) every lmforge image reference
    (a task's image, the ``job_image`` and ``predictor_image`` constants) names this code's content tag.
    """
    tag = None if runner == "subprocess" else content_tag()

    def local(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: local(value) for key, value in node.items() if key != "retryPolicy"}
        if isinstance(node, list):
            return [local(item) for item in node]
        if tag and isinstance(node, str):
            return with_tag(node, tag)
        return node

    return yaml.safe_dump_all([local(doc) for doc in yaml.safe_load_all(spec_text)], sort_keys=False)


@contextlib.contextmanager
def _logs_to(stream: TextIO) -> Iterator[None]:
    """The root logger's records (kfp.local's orchestrator: skipped tasks, the workspace) go to ``stream`` too."""
    root = logging.getLogger()
    saved = root.handlers[:]
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s.000 - %(levelname)s - %(message)s", datefmt="%H:%M:%S"))
    root.handlers = [handler]
    try:
        yield
    finally:
        root.handlers = saved


def run_pipeline_locally(
    params: dict[str, Any],
    pipeline_root: Path,
    pipeline_yaml: Path = COMPILED_PIPELINE,
    *,
    console: str = "verbose",
    out: TextIO | None = None,
    runner: str = "subprocess",
    containers: ContainerSettings | None = None,
) -> LocalRun:
    """Run the compiled pipeline with ``SubprocessRunner(use_venv=False)`` or in containers; raise if a task fails.

    Each call gets its own directory ``<pipeline_root>/<run id>/`` (:func:`new_run_id`), so two runs
    started on one ``--output`` never share, or mistake each other's, outputs.

    Args:
        params: pipeline arguments.
        pipeline_root: where run directories go.
        pipeline_yaml: the compiled pipeline (run as :func:`local_pipeline` makes it).
        console: what ``out`` shows: ``verbose`` (everything kfp.local prints), ``default`` (a line per stage and
            the training progress) or ``quiet`` (nothing); every line also goes to the run's ``logs/``.
        out: where the shown lines go (default: stdout).
        runner: ``subprocess`` (this Python), or ``docker`` / ``podman``: each task in the image the compiled
            pipeline names, under this code's content tag, through the Docker API (:mod:`lmforge_kfp.containers`).
        containers: mounts, network and environment of the containers (the run's own folder is always mounted).

    Raises:
        PipelineRunError: a task failed; its message is the task's own ``error:`` line when it wrote one.
    """
    run_id = new_run_id()
    run_root = Path(pipeline_root).resolve() / run_id
    run_root.mkdir(parents=True)  # never exist_ok: a run directory belongs to one run
    local_yaml = run_root / "pipeline.yaml"
    local_yaml.write_text(local_pipeline(Path(pipeline_yaml).read_text(encoding="utf-8"), runner), encoding="utf-8")
    logs = run_root / LOGS
    router = RunConsole(logs, out or sys.stdout, console)
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        _start_local(stack, runner, containers, run_id, local_yaml, router)
        _run(load_component_from_file(str(local_yaml)), params, run_id, run_root, router)
    seconds = time.perf_counter() - start
    new = sorted(p for p in run_root.iterdir() if p.is_dir() and p.name != LOGS)
    if len(new) != 1:
        raise RuntimeError(f"expected one new run directory under {run_root}, found {[p.name for p in new]}")
    return LocalRun(new[0], seconds, logs)


def _start_local(
    stack: contextlib.ExitStack,
    runner: str,
    containers: ContainerSettings | None,
    run_id: str,
    local_yaml: Path,
    router: RunConsole,
) -> None:
    """Start kfp.local with ``runner`` for the run in ``local_yaml``'s folder, until ``stack`` closes.

    What starting logs (a podman service, the Docker runner's install settings) goes to the run's log only.
    """
    stack.enter_context(_logs_to(router))
    if runner == "subprocess":
        task_runner = local.SubprocessRunner(use_venv=False)
    else:
        settings = containers or ContainerSettings()
        settings = replace(settings, environment={**settings.environment, RUN_ID_ENV: run_id})
        task_runner = stack.enter_context(container_runner(runner, local_yaml, settings))
    local.init(runner=task_runner, pipeline_root=str(local_yaml.parent), raise_on_error=True)


def _run(pipeline: Any, params: dict[str, Any], run_id: str, run_root: Path, router: RunConsole) -> None:
    """Run ``pipeline`` under kfp.local (initialized), its output routed to ``router``; raise if a task fails."""
    with (
        warnings.catch_warnings(),
        environ_set({RUN_ID_ENV: run_id}),
        contextlib.redirect_stdout(router),
        _logs_to(router),
    ):
        # Resource, placement and image settings are for the cluster; kfp.local says so once per task.
        warnings.filterwarnings("ignore", message=".*have no effect in the current local runner.*")
        warnings.filterwarnings("ignore", message=".*custom or non-Python base image.*")
        try:
            pipeline(**params)
        except RuntimeError as exc:  # kfp.local's way of saying a task failed
            failed = router.failed_task
            router.close()
            reason = router.error_line or ANSI.sub("", str(exc))
            log = router.log_path(failed)
            raise PipelineRunError(
                f"{reason.removeprefix('error: ')} (task {failed}; log: {log})", run_dir=run_root, task=failed, log=log
            ) from exc
    router.close()
