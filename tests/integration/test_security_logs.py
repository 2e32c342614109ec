"""Verbose logs never carry credentials: botocore, urllib3 and s3transfer stay at INFO under ``-v``."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from lmforge import storage
from lmforge.cli import setup_cli_logging
from lmforge.component_io import CREDENTIAL_LOGGERS, setup_logging
from tests.support.s3server import ACCESS_KEY, SECRET_KEY

SESSION_TOKEN = "FwoGZXIvYXdzEXAMPLEsessionTOKEN0123456789abcdef"


@pytest.mark.s3
@pytest.mark.parametrize("session_token", [SESSION_TOKEN, None], ids=["session-token", "keys-only"])
def test_verbose_stage_against_s3_logs_no_credential(s3_env, s3_server, shakespeare_docs, tmp_path, session_token):
    """``lmforge stage clean -v`` against the S3 test server: no log line names a credential.

    SeaweedFS does not accept STS session tokens: with one the first request (signed, token attached) is refused
    with 403 and the stage stops there; without one the whole stage runs (reading the corpus from S3).
    """
    bucket = s3_env
    storage.write_bytes(
        f"s3://{bucket}/raw.jsonl",
        b"".join(json.dumps(doc).encode() + b"\n" for doc in shakespeare_docs[:5]),
    )
    env = {**os.environ, **s3_server.env(), **({"AWS_SESSION_TOKEN": session_token} if session_token else {})}
    command = ["stage", "clean", "-v", f"--io=corpus_uri=s3://{bucket}/raw.jsonl", f"--io=cleaned={tmp_path / 'out'}"]
    proc = subprocess.run(
        [sys.executable, "-m", "lmforge", *command], env=env, capture_output=True, text=True, timeout=300
    )

    log = proc.stdout + proc.stderr
    if session_token:
        assert proc.returncode == 2 and "(403)" in log, log[-3000:]  # the signed request reached the server
    else:
        assert proc.returncode == 0, log[-3000:]
        assert " DEBUG lmforge" in log  # verbose mode is on for lmforge itself
        assert (tmp_path / "out" / "manifest.json").is_file()
    for secret in (SESSION_TOKEN, ACCESS_KEY, SECRET_KEY, "X-Amz-Security-Token", "Authorization", "Credential="):
        leaked = [line for line in log.splitlines() if secret in line]
        assert not leaked, f"{secret!r} appears in {len(leaked)} log lines, e.g. {leaked[0][:300]}"


@pytest.mark.parametrize("setup", [lambda: setup_logging(logging.DEBUG), lambda: setup_cli_logging(True)])
def test_both_verbose_setups_cap_the_credential_loggers_at_info(setup):
    setup()
    try:
        assert logging.getLogger("lmforge").isEnabledFor(logging.DEBUG)
        for name in (*CREDENTIAL_LOGGERS, "botocore.endpoint", "urllib3.connectionpool"):
            assert not logging.getLogger(name).isEnabledFor(logging.DEBUG), name
    finally:
        logging.basicConfig(level=logging.WARNING, force=True)
