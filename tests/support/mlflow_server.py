"""A real MLflow tracking server on loopback for tests: ``mlflow server`` from the PyPI package ``mlflow``.

The full ``mlflow`` package pins ``pyarrow`` below the version the rest of lmforge's environment uses, so the
server lives in a virtual environment of its own (the client, ``mlflow-skinny``, is in the main one). The
executable is found, in this order, at ``$LMFORGE_MLFLOW_SERVER``, at ``.venv-mlflow-server/bin/mlflow`` in the
repository (made by ``python -m venv .venv-mlflow-server && .venv-mlflow-server/bin/pip install mlflow boto3``),
or as an ``mlflow`` on ``PATH`` that can import the server. :func:`server_executable` says which, or why none.

Started with a SQLite backend store in a throwaway directory, one free port on 127.0.0.1, artifacts served by
the server itself (``--serve-artifacts``) from a local folder or an ``s3://`` destination on the SeaweedFS test
server, and optionally MLflow's basic-auth app. Start-up waits a bounded time for ``/health``; stop sends
SIGTERM to the process group, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.server_process import start_logged, wait_until_ready

REPO = Path(__file__).resolve().parents[2]
VENV_MLFLOW = REPO / ".venv-mlflow-server" / "bin" / "mlflow"
ADMIN_USER = "admin"
ADMIN_PASSWORD = "lmforge-test-admin-password"  # basic-auth app: the admin account it creates on first start


def _can_serve(executable: str) -> bool:
    """True when ``executable``'s Python can import the tracking server (the skinny client cannot)."""
    python = Path(executable).with_name("python")
    probe = [str(python)] if python.exists() else [executable]
    code = "import mlflow.server, sqlalchemy, alembic"
    try:
        if python.exists():
            done = subprocess.run([*probe, "-c", code], capture_output=True, timeout=60)
        else:
            done = subprocess.run([executable, "server", "--help"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def server_executable() -> tuple[str | None, str]:
    """The ``mlflow`` executable that can run ``mlflow server``, and where it came from (or why there is none)."""
    candidates = [
        ("$LMFORGE_MLFLOW_SERVER", os.environ.get("LMFORGE_MLFLOW_SERVER")),
        (".venv-mlflow-server", str(VENV_MLFLOW) if VENV_MLFLOW.exists() else None),
        ("PATH", shutil.which("mlflow")),
    ]
    for origin, path in candidates:
        if path and _can_serve(path):
            return path, origin
    return None, (
        "no mlflow tracking server: python -m venv .venv-mlflow-server && "
        ".venv-mlflow-server/bin/pip install mlflow boto3 (or set LMFORGE_MLFLOW_SERVER)"
    )


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class MlflowServer:
    """One ``mlflow server`` process; :meth:`start` / :meth:`stop` / :meth:`restart`, or use as a context manager.

    Attributes:
        workdir: holds the SQLite store, the local artifacts (when ``artifacts_destination`` is None) and the log.
        executable: the ``mlflow`` to run (see :func:`server_executable`).
        artifacts_destination: ``s3://bucket/prefix`` for the served artifacts, or None for ``workdir/artifacts``.
        env: extra environment of the server process (the S3 endpoint and credentials for an ``s3://`` destination).
        basic_auth: run MLflow's basic-auth app (HTTP basic auth; admin ``ADMIN_USER`` / ``ADMIN_PASSWORD``).
    """

    workdir: Path
    executable: str
    artifacts_destination: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    basic_auth: bool = False
    port: int = 0
    process: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        """The tracking URI clients use."""
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> MlflowServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 120.0) -> None:
        """Start the server (same port and store on a restart) and wait until ``/health`` answers."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port()
        destination = self.artifacts_destination or str(self.workdir / "artifacts")
        cmd = [
            self.executable,
            "server",
            "--host=127.0.0.1",
            f"--port={self.port}",
            f"--backend-store-uri=sqlite:///{self.workdir / 'mlflow.db'}",
            "--serve-artifacts",
            f"--artifacts-destination={destination}",
            "--workers=1",
        ]
        # No background job runner (seven huey worker processes, each importing mlflow): nothing here uses it.
        env = {**os.environ, **self.env, "MLFLOW_TRACKING_URI": "", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        env["MLFLOW_DISABLE_TELEMETRY"] = "true"  # no usage reports from a test server
        for key in [k for k in env if k.startswith("MLFLOW_HTTP_REQUEST")]:
            env.pop(key)  # the client tuning of the test process is no business of the server's
        if "AWS_ENDPOINT_URL" in self.env:
            env["MLFLOW_S3_ENDPOINT_URL"] = self.env["AWS_ENDPOINT_URL"]
        if self.basic_auth:
            cmd.append("--app-name=basic-auth")
            auth_ini = self.workdir / "basic_auth.ini"
            auth_ini.write_text(
                "[mlflow]\n"
                "default_permission = READ\n"
                f"database_uri = sqlite:///{self.workdir / 'auth.db'}\n"
                f"admin_username = {ADMIN_USER}\n"
                f"admin_password = {ADMIN_PASSWORD}\n"
                "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
            )
            env["MLFLOW_AUTH_CONFIG_PATH"] = str(auth_ini)
            env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = "lmforge-test-flask-key"
        log = self.workdir / "mlflow-server.log"
        self.process = start_logged(cmd, log, env=env, cwd=self.workdir)
        wait_until_ready(
            self.process, self._healthy, timeout=timeout, log=log, program="mlflow server", service="mlflow server",
            stop=self.stop,
        )  # fmt: skip

    def _healthy(self) -> bool:
        """True when ``/health`` answers 200."""
        with (
            contextlib.suppress(OSError, urllib.error.URLError),
            urllib.request.urlopen(f"{self.uri}/health", timeout=2) as resp,
        ):
            return resp.status == 200
        return False

    def stop(self) -> None:
        """Stop the server (SIGTERM to its process group, then SIGKILL), keeping its store for a restart."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=15)
        self.process = None

    def restart(self) -> None:
        """Stop and start again on the same port and store."""
        self.stop()
        self.start()
