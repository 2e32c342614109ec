"""Interrupted promotions and publishes: a version is never burned, and `lmforge registry gc` cleans up."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lmforge import storage
from lmforge.artifacts import PUBLISH_CLAIM, write_manifest
from lmforge.cli import application
from lmforge.errors import StorageError
from lmforge.launch.stage_runner import publish_artifact
from lmforge.release.catalog import CLAIM, latest_release
from lmforge.release.promote import promote

MODEL = "tiny"


def _artifact(root: Path, kind: str, files: dict[str, str]) -> Path:
    root.mkdir(parents=True)
    for name, text in files.items():
        (root / name).write_text(text)
    write_manifest(root, kind)
    return root


@pytest.fixture
def inputs(tmp_path) -> dict[str, Path]:
    evaluation = tmp_path / "in" / "evaluation"
    evaluation.mkdir(parents=True)
    (evaluation / "results.json").write_text(json.dumps({"passed": True, "production": {"status": "none"}}))
    write_manifest(evaluation, "evaluation")
    return {
        "student": _artifact(tmp_path / "in" / "student", "model", {"config.json": "{}", "a.bin": "abc" * 1000}),
        "int8_qdq": _artifact(tmp_path / "in" / "qdq", "onnx", {"model.onnx": "onnx"}),
        "evaluation": evaluation,
    }


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def registry(request, tmp_path) -> str:
    if request.param == "s3":
        return f"s3://{request.getfixturevalue('s3_env')}/registry"
    return str(tmp_path / "registry")


def _promote(registry: str, inputs: dict[str, Path], version: str = "v1"):
    artifacts = {k: v for k, v in inputs.items() if k != "evaluation"}
    return promote(
        model_name=MODEL,
        release_root=registry,
        version=version,
        artifacts=artifacts,
        evaluation_dir=inputs["evaluation"],
    )


def _enospc(uri: str) -> Exception:
    return OSError(errno.ENOSPC, "No space left on device", uri)


def _storage_enospc(uri: str) -> Exception:  # what storage raises once it turns OSError into one line
    return StorageError(f"cannot write {uri}: No space left on device")


@pytest.mark.parametrize("error", [_enospc, _storage_enospc])
def test_a_disk_full_promotion_fails_in_one_line_and_does_not_burn_the_version(registry, inputs, monkeypatch, error):
    upload = storage.upload_file
    calls = []

    def upload_until_the_disk_is_full(local, uri):
        calls.append(uri)
        if len(calls) == 4:  # the student (3 files) is copied, the next artifact hits a full disk
            raise error(str(uri))
        upload(local, uri)

    monkeypatch.setattr(storage, "upload_file", upload_until_the_disk_is_full)
    with pytest.raises(StorageError) as failure:
        _promote(registry, inputs)
    message = str(failure.value)
    assert "\n" not in message and "No space left on device" in message and calls[-1] in message
    assert "can be promoted again" in message
    target = storage.join(registry, "models", "tiny", "v1")
    assert not storage.exists(target)  # no claim, no partial copy, no .tmp

    monkeypatch.setattr(storage, "upload_file", upload)
    assert _promote(registry, inputs).summary["version"] == "v1"  # the version was not burned
    assert latest_release(registry, "tiny")["version"] == "v1"


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


_PROMOTE = """
import sys
from pathlib import Path
from lmforge.errors import StorageError
from lmforge.release.promote import promote
src = Path(sys.argv[1])
try:
    promote(model_name="tiny", release_root=sys.argv[2], version="v1", evaluation_dir=src / "evaluation",
            artifacts={"student": src / "student", "int8_qdq": src / "qdq"})
except StorageError as exc:
    print("ERROR", exc)
"""


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs `unshare -m` and mount rights for a private 64 KiB tmpfs")
def test_a_promotion_onto_a_really_full_disk_says_cannot_write_naming_the_destination(tmp_path, inputs):
    (inputs["student"] / "a.bin").write_bytes(os.urandom(200_000))  # more than the 64 KiB disk holds
    write_manifest(inputs["student"], "model")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = (
        f"mount -t tmpfs -o size=64k tmpfs {disk} || exit 99\n{sys.executable} -c '{_PROMOTE}' {tmp_path / 'in'} {disk}"
    )
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [error] = [line for line in proc.stdout.splitlines() if line.startswith("ERROR")]
    destination = disk / "models" / "tiny" / "v1" / "student" / "a.bin"
    assert f"cannot write {destination}: No space left on device" in error
    assert "cannot read" not in error and "can be promoted again" in error


def test_registry_gc_removes_the_stale_claim_of_a_killed_promotion(registry, inputs):
    target = storage.join(registry, "models", "tiny", "v1")
    # what SIGKILL mid-copy leaves: the claim and part of the first artifact, no release manifest
    storage.write_bytes(storage.join(target, CLAIM), json.dumps({"claimed_at": "2026-01-01T00:00:00.000Z"}).encode())
    storage.write_bytes(storage.join(target, "student", "a.bin"), b"abc")
    runner = CliRunner()

    result = runner.invoke(application(), ["registry", "gc", registry])  # claimed long before the default 24 h
    assert result.exit_code == 0, result.output
    assert f"removed release {target}" in result.output
    assert not storage.exists(target)
    assert _promote(registry, inputs).summary["version"] == "v1"

    again = runner.invoke(application(), ["registry", "gc", registry, "--older-than-hours", "0"])
    assert again.exit_code == 0 and "nothing to clean" in again.output  # a complete release is never touched
    assert latest_release(registry, "tiny")["version"] == "v1"


def test_registry_gc_leaves_a_claim_younger_than_the_threshold(registry, inputs):
    from lmforge.release.promote import _now

    target = storage.join(registry, "models", "tiny", "v1")
    storage.write_bytes(storage.join(target, CLAIM), json.dumps({"claimed_at": _now()}).encode())
    result = CliRunner().invoke(application(), ["registry", "gc", registry, "--dry-run"])
    assert result.exit_code == 0 and "nothing to clean" in result.output
    assert storage.is_file(storage.join(target, CLAIM))  # a promotion may still be copying


def test_registry_gc_frees_a_prefix_claimed_by_a_publisher_that_died(registry, tmp_path):
    prefix = storage.join(registry, "staging", "run-1", "task", "model")
    storage.write_bytes(
        storage.join(prefix, PUBLISH_CLAIM),
        json.dumps({"manifest_sha256": "0" * 64, "claimed_at": "2026-01-01T00:00:00Z"}).encode(),
    )
    storage.write_bytes(storage.join(prefix, "weights.bin"), b"half")
    result = CliRunner().invoke(application(), ["registry", "gc", registry, "--older-than-hours", "1"])
    assert result.exit_code == 0 and f"removed artifact {prefix}" in result.output
    artifact = _artifact(tmp_path / "model", "model", {"weights.bin": "whole"})
    assert publish_artifact(artifact, prefix) is True


@pytest.mark.s3
def test_registry_gc_aborts_incomplete_multipart_uploads_under_the_root(s3_env):
    client = storage.s3_client()
    key = "registry/models/tiny/v9/student/model.safetensors"
    upload = client.create_multipart_upload(Bucket=s3_env, Key=key)
    client.upload_part(Bucket=s3_env, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 1024)
    outside = client.create_multipart_upload(Bucket=s3_env, Key="elsewhere/file")

    root = f"s3://{s3_env}/registry"
    result = CliRunner().invoke(application(), ["registry", "gc", root, "--older-than-hours", "0"])
    assert result.exit_code == 0, result.output
    assert f"removed upload s3://{s3_env}/{key}" in result.output
    left = client.list_multipart_uploads(Bucket=s3_env).get("Uploads", [])
    assert [u["UploadId"] for u in left] == [outside["UploadId"]]
