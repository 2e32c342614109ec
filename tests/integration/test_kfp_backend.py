"""The KFP backend's own code (kubeflow/pipelines 2.17.0) on every compiled pipeline: compiler, GPU limits, loops.

``../shared/tools/kfp-backend-check/`` holds three programs built from the backend's Go sources (its README lists
which files are used unmodified or copied verbatim): ``lmforgecheck`` runs the Argo compiler as the API server
does at run creation, ``gpucheck`` the driver's accelerator resolution for every task, ``loopcheck`` the drivers'
type validation for every ``ParallelFor`` item against every consumer. CI has the folder; a user's clone does
not, and these tests then skip saying so. No cluster is involved.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from lmforge_kfp.pipelines.compile import REPO_ROOT

TOOLS = REPO_ROOT.parent / "shared" / "tools" / "kfp-backend-check" / "bin"
COMPILED = sorted((REPO_ROOT / "pipelines" / "compiled").glob("*.yaml"))
CHECKS = ("lmforgecheck", "gpucheck", "loopcheck")

pytestmark = pytest.mark.skipif(
    not (TOOLS / "kfp-backend-check").is_file(),
    reason=f"KFP backend checks not present at {TOOLS} (they ship beside the repository in CI, not with it)",
)


def _run(check: str, pipeline: Path, *params: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(TOOLS / check), str(pipeline), *params], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("pipeline", COMPILED, ids=lambda p: p.name)
def test_backend_accepts_the_compiled_pipeline(check: str, pipeline: Path) -> None:
    result = _run(check, pipeline)
    failures = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert result.returncode == 0, f"{check} exit {result.returncode}: {failures or result.stderr.strip()[-2000:]}"
    if check != "lmforgecheck":
        assert "OK" in result.stdout  # something was checked: a task with an accelerator, a loop
