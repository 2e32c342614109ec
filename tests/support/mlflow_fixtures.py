"""Fixtures for the tracking tests: a real ``mlflow server`` for the session, artifacts on the SeaweedFS S3 server.

tests/conftest.py imports them, so that one server serves the whole session. A test that needs the server
(or the executable) is skipped, saying how to install it, when there is none.
"""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Iterator

import pytest

from tests.support.mlflow_server import MlflowServer, server_executable


@pytest.fixture(scope="session")
def mlflow_executable() -> str:
    """The ``mlflow`` executable that runs ``mlflow server`` (skips when there is none, or no client)."""
    if importlib.util.find_spec("mlflow") is None:
        pytest.skip("no MLflow client: pip install 'lmforge[tracking]'")
    executable, origin = server_executable()
    if executable is None:
        pytest.skip(origin)
    return executable


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory, s3_server, mlflow_executable) -> Iterator[MlflowServer]:
    """One tracking server for the session: SQLite store in tmp, artifacts served from a bucket on the S3 server."""
    import boto3

    env = s3_server.env()
    bucket = f"mlflow-{uuid.uuid4().hex[:10]}"
    boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    ).create_bucket(Bucket=bucket)
    server = MlflowServer(
        tmp_path_factory.mktemp("mlflow"),
        mlflow_executable,
        artifacts_destination=f"s3://{bucket}/artifacts",
        env=env,
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture
def tracking_env(mlflow_server, monkeypatch) -> Iterator[str]:
    """``MLFLOW_TRACKING_URI`` pointing at the session server and a fresh experiment name; yields the experiment."""
    experiment = f"t-{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", experiment)
    for key in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "RANK"):
        monkeypatch.delenv(key, raising=False)
    yield experiment
