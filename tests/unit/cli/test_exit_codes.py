"""An input or config error ends a process with one error line and exit code 2; anything else keeps its traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lmforge.errors import (
    ArtifactIncompleteError,
    ConfigError,
    FieldMissingError,
    InputDataError,
    LmforgeError,
    ReleaseExistsError,
    StorageError,
)
from lmforge.exit_codes import EXIT_FAILURE, EXIT_INPUT_ERROR, error_line, exit_code
from lmforge.preflight.preflight import PreflightError
from lmforge.train.loop import TrainingPreempted


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ConfigError("pretrain.train.lr: bad"), EXIT_INPUT_ERROR),
        (InputDataError("qa.jsonl:1: no 'prompt' field"), EXIT_INPUT_ERROR),
        (FieldMissingError("x", field="text", fields=("content",)), EXIT_INPUT_ERROR),
        (PreflightError("preflight failed: corpus_sample: ..."), EXIT_INPUT_ERROR),
        (ArtifactIncompleteError("no manifest.json"), EXIT_INPUT_ERROR),
        (ReleaseExistsError("release v1 exists"), EXIT_INPUT_ERROR),
        (StorageError("get s3://b/k: S3 error 503"), EXIT_FAILURE),
        (TrainingPreempted("SIGTERM at step 40"), EXIT_FAILURE),
        (LmforgeError("something else"), EXIT_FAILURE),
        (RuntimeError("a bug"), EXIT_FAILURE),
    ],
)
def test_exit_code_is_2_for_input_and_config_errors_only(exc, code):
    assert exit_code(exc) == code


def test_error_line_is_one_line():
    assert error_line(InputDataError("a.jsonl:3: bad\nsecond line")) == "error: a.jsonl:3: bad second line"


_CHILD = """
import logging, sys
from lmforge.errors import InputDataError
from lmforge.exit_codes import exit_on_input_error
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
with exit_on_input_error():
    logging.getLogger("lmforge.clean").info("reading the corpus")
    raise {error}
"""


def _child(error: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _CHILD.format(error=error)], capture_output=True, text=True, timeout=120
    )


def test_an_input_error_exits_2_with_one_error_line_last_and_no_traceback():
    run = _child("InputDataError(\"corpus docs.jsonl:1: field 'text' missing\")")
    assert run.returncode == EXIT_INPUT_ERROR
    lines = run.stderr.strip().splitlines()
    assert lines[-1] == "ERROR lmforge: error: corpus docs.jsonl:1: field 'text' missing"
    assert "Traceback" not in run.stderr


def test_any_other_error_keeps_its_traceback_and_exits_1():
    run = _child('RuntimeError("a bug")')
    assert run.returncode == EXIT_FAILURE
    assert "Traceback" in run.stderr and run.stderr.strip().endswith("RuntimeError: a bug")
