"""What kfp.local logs when a run starts goes to the run's log, not to the person's console."""

import contextlib
import io
import logging

from kfp import local

from lmforge_kfp.pipelines import local_run
from lmforge_kfp.pipelines.console import RunConsole


def test_the_docker_runners_install_settings_stay_in_the_runs_log(tmp_path, monkeypatch) -> None:
    @contextlib.contextmanager
    def engine_at_hand(engine, pipeline_yaml, settings):  # the engine and its images: not what this test is about
        yield local.DockerRunner()  # kfp 2.17 logs its pip-install settings as it is made

    monkeypatch.setattr(local_run, "container_runner", engine_at_hand)
    # As `lmforge run` sets up logging: the root logger shows INFO records on the console.
    console = io.StringIO()
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    root.handlers, root.level = [logging.StreamHandler(console)], logging.INFO
    shown = io.StringIO()
    router = RunConsole(tmp_path / "logs", shown, "default")
    try:
        with contextlib.ExitStack() as stack:
            local_run._start_local(stack, "podman", None, "run-1", tmp_path / "pipeline.yaml", router)
    finally:
        root.handlers, root.level = saved_handlers, saved_level
        router.close()
    assert "PipInstallManager" not in console.getvalue() + shown.getvalue()
    assert "PipInstallManager" in (tmp_path / "logs" / "run.log").read_text()
