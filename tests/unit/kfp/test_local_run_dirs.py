"""Two `lmforge run` on one --output: each gets its own run directory."""

import json
import subprocess
import sys
from pathlib import Path

from kfp import compiler, dsl


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def meet(rendezvous: str, me: str) -> str:
    """Wait until both runs are inside their task, so the two runs overlap whatever the scheduling."""
    import pathlib
    import time

    folder = pathlib.Path(rendezvous)
    (folder / me).touch()
    for _ in range(1200):
        if len(list(folder.iterdir())) >= 2:
            return me
        time.sleep(0.1)
    raise RuntimeError("the other run never reached its task")


@dsl.pipeline(name="rendezvous")
def rendezvous(rendezvous: str, me: str) -> str:
    return meet(rendezvous=rendezvous, me=me).output


RUN = """
import json, sys
from lmforge_kfp.pipelines.local_run import run_pipeline_locally
run = run_pipeline_locally(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3])
print(run.run_dir)
"""


def test_two_concurrent_local_runs_on_one_output_get_their_own_run_directories(tmp_path):
    yaml = tmp_path / "rendezvous.yaml"
    compiler.Compiler().compile(rendezvous, str(yaml))
    (tmp_path / "meet").mkdir()
    runs = tmp_path / "out" / "runs"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RUN,
                json.dumps({"rendezvous": str(tmp_path / "meet"), "me": me}),
                str(runs),
                str(yaml),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for me in ("a", "b")
    ]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-2000:]
    run_dirs = [Path(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert run_dirs[0] != run_dirs[1]
    assert run_dirs[0].parent.parent == run_dirs[1].parent.parent == runs.resolve()
    assert len(list(runs.iterdir())) == 2
