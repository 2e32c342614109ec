"""The images built here, and the DAG's stages run inside them through the Docker API (podman, or Docker).

One slow module: the cpu and serve images are built once per session with ``make local-images`` (the local
Debian base, ``make base-image``, then the Dockerfiles; podman's layer cache makes a rebuild after a source change
cost only the lmforge wheel's layer). Where no container engine can run, every test skips and says why.
The stages run under kfp.local with :mod:`lmforge_kfp.containers`' runner, as ``lmforge run --runner podman`` runs
them: as uid 10001, read-only root file system, no network.
"""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lmforge.artifacts import fingerprint, read_manifest
from tests.support.serve_helpers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[2]
BASE = "localhost/lmforge-base:bookworm"
PRETRAIN_2_STEPS = {"train.max_steps": 2, "train.warmup_steps": 1, "train.eval_interval": 2}
READY_TIMEOUT_S = 180.0
CLEAN_DATA = ("part-00000.parquet", "quarantine.jsonl", "bad_records.jsonl")


def _file_digests(artifact: Path, names: tuple[str, ...]) -> dict[str, str]:
    """The sha256 of each of ``names`` as the artifact's verified manifest records it."""
    files = read_manifest(artifact, verify=True)["files"]
    return {name: files[name]["sha256"] for name in names}


def _engine() -> str:
    """The engine the tests use: podman when installed (no daemon), else a Docker whose daemon answers."""
    os.environ.setdefault("CONTAINERS_CONF", str(REPO / "images" / "containers.conf"))
    for engine in ("podman", "docker"):
        if shutil.which(engine) and subprocess.run([engine, "info"], capture_output=True).returncode == 0:
            return engine
    pytest.skip("no container engine can run here: podman not installed and no Docker daemon (.ci/run installs podman)")


@pytest.fixture(scope="session")
def engine() -> str:
    engine = _engine()
    if engine == "podman" and os.geteuid() != 0:
        pytest.skip("the container tests need rootful podman (the run's folders are handed to the images' uid 10001)")
    return engine


def _build(engine: str, images: str, log: Path) -> None:
    """``make local-images`` for ``images``: the one command a fresh clone builds its images with."""
    cmd = ["make", "local-images", f"ENGINE={engine}", f"LOCAL_IMAGES={images}", f"PYTHON={sys.executable}"]
    with open(log, "wb") as out:
        done = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        pytest.fail(f"{' '.join(cmd)} failed ({done.returncode}):\n{tail}")


@pytest.fixture(scope="session")
def cpu_image(engine: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    from lmforge_kfp.components.images import image_for

    _build(engine, "cpu", tmp_path_factory.mktemp("build") / "cpu.log")
    return image_for("clean")


@pytest.fixture(scope="session")
def serve_image(engine: str, cpu_image: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    from lmforge_kfp.components.images import service_image

    _build(engine, "serve", tmp_path_factory.mktemp("build") / "serve.log")
    return service_image("serve")


def _smoke_pipeline(folder: Path, cpu_image: str) -> Path:
    """preflight → clean → tokenize → pretrain, compiled; every task in the cpu image (the tiny-cpu stages need no
    CUDA, and the train image's CPU form holds the cpu image's packages)."""
    from kfp import compiler, dsl

    from lmforge_kfp.components import load_component
    from lmforge_kfp.components.images import image_for

    preflight, clean, tokenize, pretrain = (load_component(n) for n in ("preflight", "clean", "tokenize", "pretrain"))

    # (this module has no `from __future__ import annotations`: KFP reads the pipeline's annotations as types)
    @dsl.pipeline(name="containers-smoke")
    def smoke(corpus_uri: str, release_root: str, pretrain_overrides: str) -> None:
        checked = preflight(
            corpus_uri=corpus_uri, qa_uri="demo://chatterbot", release_root=release_root, gpu_count=0
        ).set_caching_options(False)
        cleaned = clean(corpus_uri=corpus_uri, corpus_fingerprint=checked.outputs["corpus_fingerprint"])
        cleaned.set_caching_options(False)
        tokens = tokenize(
            cleaned=cleaned.outputs["cleaned"], base_model_fingerprint=checked.outputs["base_model_fingerprint"]
        ).set_caching_options(False)
        pretrain(
            shards=tokens.outputs["shards"],
            tokenizer=tokens.outputs["tokenizer"],
            base_model_fingerprint=checked.outputs["base_model_fingerprint"],
            overrides=pretrain_overrides,
            gpu_count=0,
            run_root=checked.outputs["run_root"],
        ).set_caching_options(False)

    path = folder / "smoke.yaml"
    compiler.Compiler().compile(smoke, str(path))
    path.write_text(path.read_text(encoding="utf-8").replace(image_for("pretrain"), cpu_image), encoding="utf-8")
    return path


def _run(pipeline: Path, out: Path, runner: str, corpus: str = "demo://shakespeare"):
    from lmforge_kfp.containers import ContainerSettings
    from lmforge_kfp.pipelines.local_run import run_pipeline_locally

    registry = out / "registry"
    registry.mkdir(parents=True, exist_ok=True)
    params = {
        "corpus_uri": corpus,
        "release_root": str(registry),
        "pretrain_overrides": json.dumps(PRETRAIN_2_STEPS),
    }
    # The host's thread count (tests/__init__.py): with another, matmuls sum in another order, and the weights are
    # compared bit for bit.
    threads = {"OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]}
    settings = ContainerSettings(mounts=(registry,), environment=threads)
    return run_pipeline_locally(params, out / "runs", pipeline, console="quiet", runner=runner, containers=settings)


def test_stages_run_in_the_cpu_image_and_match_the_subprocess_runner(engine, cpu_image, tmp_path) -> None:
    pipeline = _smoke_pipeline(tmp_path, cpu_image)
    host = _run(pipeline, tmp_path / "host", "subprocess")
    contained = _run(pipeline, tmp_path / "containers", engine)

    for task, artifact in (("tokenize", "tokenizer"), ("tokenize", "shards")):
        expected = read_manifest(host.output(task, artifact), verify=True)
        got = read_manifest(contained.output(task, artifact), verify=True)
        assert fingerprint(got) == fingerprint(expected), f"{task}.{artifact} differs inside the container"
    # clean's and pretrain's own fingerprints cover their timings (stats.json, report.html, training_history.json):
    # their data and weights must be the same bytes
    for task, artifact, data in (("clean", "cleaned", CLEAN_DATA), ("pretrain", "model", ("model.safetensors",))):
        expected, got = (_file_digests(run.output(task, artifact), data) for run in (host, contained))
        assert got == expected, f"{task}.{artifact}: {sorted(data)} differ inside the container"
    assert read_manifest(contained.output("pretrain", "model"), verify=True)["kind"] == "model"
    if os.geteuid() == 0:  # written inside the containers, by the images' user
        written = {task: contained.output(task, "executor_output.json").stat().st_uid for task in ("clean", "pretrain")}
        assert written == {"clean": 10001, "pretrain": 10001}


def test_a_task_failing_in_its_container_fails_the_run_with_its_error_line(engine, cpu_image, tmp_path) -> None:
    from lmforge_kfp.pipelines.local_run import PipelineRunError

    missing = tmp_path / "no-such-corpus"
    with pytest.raises(PipelineRunError) as failed:
        _run(_smoke_pipeline(tmp_path, cpu_image), tmp_path / "out", engine, corpus=str(missing))
    assert failed.value.task == "preflight"
    assert str(missing) in str(failed.value)
    assert not (failed.value.run_dir / "clean").exists()


def test_run_container_returns_the_container_exit_status(engine, cpu_image) -> None:
    """kfp.local's own call loses it with podman (docs/kubeflow.md); the replacement keeps it."""
    import docker

    from lmforge_kfp.containers import ContainerSettings, docker_api, run_container

    with docker_api(engine):
        client = docker.from_env()
        try:
            status = run_container(
                client, cpu_image, ["sh", "-c", "echo failing; exit 3"], {}, settings=ContainerSettings()
            )
        finally:
            client.close()
    assert status == 3


def test_cpu_image_runs_a_stage_read_only_as_uid_10001(engine, cpu_image, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    if os.geteuid() == 0:
        os.chown(out, 10001, 10001)
    cmd = [engine, "run", "--rm", "--read-only", "--tmpfs", "/tmp", "--user", "10001:10001", "--network", "none"]
    cmd += ["-v", f"{out}:{out}", cpu_image, "lmforge", "stage", "clean"]
    cmd += ["--io", "corpus_uri=demo://shakespeare", "--io", f"cleaned={out / 'cleaned'}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert read_manifest(out / "cleaned", verify=True)["kind"] == "cleaned-corpus"


@contextlib.contextmanager
def _container(engine: str, args: list[str]) -> Iterator[str]:
    name = f"lmforge-test-{os.getpid()}-{time.monotonic_ns()}"
    subprocess.run([engine, "run", "-d", "--name", name, *args], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run([engine, "rm", "-f", name], capture_output=True)


def test_serve_image_answers_ready_for_a_release(engine, serve_image, tiny_model_dir, tmp_path) -> None:
    """A release's served ONNX model (the tiny test model exported, as the pipeline's export step does)."""
    from lmforge.config import ExportConfig
    from lmforge.export.export_onnx import run as export_onnx

    served = tmp_path / "onnx"
    export_onnx(ExportConfig(), model=tiny_model_dir, onnx_model=served)
    # readable by the image's user, as KServe's storage initializer leaves /mnt/models for the predictor
    for path in [tmp_path, *served.rglob("*"), served]:
        path.chmod(path.stat().st_mode | (0o055 if path.is_dir() else 0o044))
    port = free_port()
    args = ["--read-only", "--tmpfs", "/tmp", "--user", "10001:10001", "--network", "host"]
    args += ["-v", f"{served}:/mnt/models:ro", serve_image, "/mnt/models", "--host", "127.0.0.1", "--port", str(port)]
    with _container(engine, args) as name:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2.0).status_code == 200:
                    break
            inspect = [engine, "inspect", "-f", "{{.State.Running}}", name]
            state = subprocess.run(inspect, capture_output=True, text=True)
            if state.stdout.strip() != "true" or time.monotonic() > deadline:
                logs = subprocess.run([engine, "logs", name], capture_output=True, text=True)
                pytest.fail(f"serve image not ready: {(logs.stdout + logs.stderr)[-3000:]}")
            time.sleep(0.5)
