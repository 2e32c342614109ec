"""bench/gpu_check.sh on a machine without a CUDA device: it completes, and every GPU row says why it did not run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from bench.gpu_check import NO_CUDA, ROW_LIMITS, ROWS, run_row

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the check would run its GPU rows")
def test_the_check_completes_without_cuda_with_every_row_skipped_and_says_so(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert json.loads(proc.stdout) == record
    assert record["cuda"] is False
    assert set(record["rows"]) == set(ROWS)
    assert {row["status"] for row in record["rows"].values()} == {NO_CUDA}
    assert record["machine"]["cpus"] == os.cpu_count()


def test_every_row_has_a_time_limit_within_the_checks_eight_minutes():
    assert set(ROW_LIMITS) == set(ROWS)
    assert sum(ROW_LIMITS.values()) < 8 * 60


def test_a_row_runs_in_a_child_process_and_reports_what_it_found():
    row = run_row("tensorrt")
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        assert row["status"].startswith("skipped: tensorrt does not import")
    else:
        assert row["status"] == "available"
    assert row["seconds"] > 0
