"""Tracking off, not rank 0, server gone, credentials refused: the stage goes on, at most one warning."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid

import pytest

from lmforge.config.tracking import TrackingConfig
from lmforge.results import StageResult
from lmforge.tracking import PipelineRun, Tracker
from tests.support.mlflow_server import ADMIN_PASSWORD, ADMIN_USER, MlflowServer, free_port

RESULT = StageResult(metrics={"train_loss": 2.0}, summary={"model_dir": "/tmp/model"})
CFG = {"train": {"lr": 0.001, "max_steps": 3}}

_OFF_SCRIPT = """
import json, sys
from lmforge.results import StageResult
from lmforge.tracking import track_stage
logged = track_stage("pretrain", {"lr": 1e-3}, StageResult(metrics={"loss": 1.0}), run_id="kfp-off")
print(json.dumps({"logged": logged, "mlflow_imported": any(m.split(".")[0] == "mlflow" for m in sys.modules)}))
"""


def _run_off(env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", _OFF_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "WARNING" not in done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lmforge.tracking" and r.levelno >= logging.WARNING]


def test_without_a_tracking_uri_nothing_is_logged_and_mlflow_is_never_imported():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    assert _run_off(env) == {"logged": None, "mlflow_imported": False}


def test_a_configured_uri_without_the_mlflow_client_installed_warns_once_and_the_stage_goes_on():
    script = "import sys; sys.modules['mlflow'] = None  # as if not installed\n" + _OFF_SCRIPT
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["logged"] is None
    assert done.stderr.count("the MLflow client is not installed") == 1


@pytest.mark.s3
def test_ranks_other_than_zero_log_nothing_and_never_import_mlflow(mlflow_server):
    experiment = f"rank-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_server.uri, "MLFLOW_EXPERIMENT_NAME": experiment, "RANK": "1"}
    assert _run_off(env) == {"logged": None, "mlflow_imported": False}
    from mlflow import MlflowClient

    assert MlflowClient(mlflow_server.uri).get_experiment_by_name(experiment) is None


def test_an_unreachable_server_costs_one_warning_naming_it_and_the_stage_goes_on(caplog):
    pytest.importorskip("mlflow", reason="no MLflow client: pip install 'lmforge[tracking]'")
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    tracker = Tracker(TrackingConfig(tracking_uri=uri, backoff_s=0.05))
    with caplog.at_level(logging.WARNING, logger="lmforge.tracking"):
        first = tracker.track_stage("pretrain", CFG, RESULT, run=PipelineRun("kfp-dead"))
        second = tracker.track_stage("evaluate", CFG, RESULT, run=PipelineRun("kfp-dead"))
    assert first is None and second is None
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    assert uri in warnings[0] and "3 attempt(s)" in warnings[0]
    assert not tracker.enabled


def test_a_password_in_the_tracking_uri_is_not_in_the_warning(caplog):
    pytest.importorskip("mlflow", reason="no MLflow client: pip install 'lmforge[tracking]'")
    uri = f"http://lmforge:uri-password-9876@127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, logger="lmforge.tracking"):
        Tracker(TrackingConfig(tracking_uri=uri, attempts=1)).track_stage("clean", CFG, RESULT, run=PipelineRun("k"))
    (warning,) = _warnings(caplog)
    assert "uri-password-9876" not in warning
    assert "lmforge:***@127.0.0.1" in warning


@pytest.mark.slow
def test_a_server_stopped_mid_run_lets_the_stage_finish_with_one_warning(mlflow_executable, tmp_path, caplog):
    with MlflowServer(tmp_path / "server", mlflow_executable) as server:
        tracker = Tracker(TrackingConfig(tracking_uri=server.uri, experiment="mid-run", backoff_s=0.05))
        run = PipelineRun("kfp-mid")
        earlier = tracker.track_stage("tokenize", CFG, RESULT, run=run)
        with caplog.at_level(logging.WARNING, logger="lmforge.tracking"):
            with tracker.stage_run("pretrain", CFG, run=run) as tracked:
                assert tracked.run_id is not None  # RUNNING on the server while the stage trains
                server.stop()  # ... and the server goes away before the stage ends
                tracked.result = RESULT
            later = tracker.track_stage("distill", CFG, RESULT, run=run)
    assert earlier is not None and later is None
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    assert server.uri in warnings[0]


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory, mlflow_executable):
    """A tracking server with MLflow's basic-auth app (admin account only)."""
    with MlflowServer(tmp_path_factory.mktemp("mlflow-auth"), mlflow_executable, basic_auth=True) as server:
        yield server


@pytest.mark.slow
def test_refused_credentials_are_reported_once_and_not_retried(auth_server, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN_USER)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "not-the-password")
    tracker = Tracker(TrackingConfig(tracking_uri=auth_server.uri, experiment="auth", backoff_s=5.0))
    with caplog.at_level(logging.WARNING, logger="lmforge.tracking"):
        assert tracker.track_stage("pretrain", CFG, RESULT, run=PipelineRun("kfp-401")) is None
        assert tracker.track_stage("evaluate", CFG, RESULT, run=PipelineRun("kfp-401")) is None
    (warning,) = _warnings(caplog)
    assert auth_server.uri in warning and "401" in warning and "not retried" in warning
    assert "not-the-password" not in warning


@pytest.mark.slow
def test_accepted_credentials_track_and_never_reach_the_run(auth_server, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN_USER)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN_PASSWORD)
    tracker = Tracker(TrackingConfig(tracking_uri=auth_server.uri, experiment="auth-ok"))
    child = tracker.track_stage("pretrain", CFG, RESULT, run=PipelineRun("kfp-auth"))

    assert child is not None
    run = MlflowClient(auth_server.uri).get_run(child)
    assert run.data.params == {"train.lr": "0.001", "train.max_steps": "3"}
    assert ADMIN_PASSWORD not in json.dumps({**run.data.params, **run.data.tags})


@pytest.mark.s3
def test_a_request_the_server_rejects_is_reported_once_without_retries(tracking_env, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_RUN_ID", "0" * 32)  # a task run that does not exist
    tracker = Tracker(TrackingConfig(backoff_s=5.0))
    with caplog.at_level(logging.WARNING, logger="lmforge.tracking"):
        assert tracker.track_stage("evaluate", CFG, RESULT, run=PipelineRun("kfp-rejected")) is None
    (warning,) = _warnings(caplog)
    assert "RESOURCE_DOES_NOT_EXIST" in warning and "not retried" in warning
