"""Fixtures for the tracking tests: a real ``mlflow server`` for the session, artifacts on the SeaweedFS S3 server.

pytest loads fixtures only from conftest.py and test modules, so the test files import these by name.
"""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Iterator

import pytest
from mlflow_server import MlflowServer, server_executable

MLFLOW_EXECUTABLE, MLFLOW_ORIGIN = server_executable()
_CLIENT = importlib.util.find_spec("mlflow") is not None
needs_mlflow_server = pytest.mark.skipif(
    MLFLOW_EXECUTABLE is None or not _CLIENT,
    reason=MLFLOW_ORIGIN if MLFLOW_EXECUTABLE is None else "no MLflow client: pip install 'lmforge[tracking]'",
)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory, s3_server) -> Iterator[MlflowServer]:
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
        MLFLOW_EXECUTABLE,
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
