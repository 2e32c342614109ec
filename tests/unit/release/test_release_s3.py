"""The release registry in real object storage (SeaweedFS on loopback) and under concurrent promotions."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from lmforge import storage
from lmforge.artifacts import read_manifest
from lmforge.errors import ReleaseExistsError
from lmforge.release.catalog import CLAIM, latest_release, list_releases, production_summary
from lmforge.release.promote import promote, update_latest
from tests.unit.release.test_release import _artifact, _evaluation

pytestmark = pytest.mark.s3

MODEL = "tiny"


@pytest.fixture
def inputs(tmp_path) -> dict[str, Path]:
    return {
        "student": _artifact(tmp_path / "in" / "student", "model", {"config.json": "{}", "w/a.bin": "abc"}),
        "evaluation": _evaluation(tmp_path / "in" / "evaluation"),
    }


def _student(tmp_path: Path, name: str) -> Path:
    """Another student (its weights differ): production never serves it yet, so promoting it publishes."""
    return _artifact(tmp_path / "in" / name, "model", {"config.json": "{}", "w/a.bin": name})


def _promote(root: str, inputs, version: str, **kwargs):
    return promote(
        model_name=MODEL,
        release_root=root,
        version=version,
        artifacts={"student": inputs["student"]},
        evaluation_dir=inputs["evaluation"],
        **kwargs,
    )


def _concurrently(fns) -> list[BaseException | object]:
    """Run every callable in its own thread, released together; their results or exceptions."""
    barrier = threading.Barrier(len(fns))
    results: list[BaseException | object] = [None] * len(fns)

    def run(i, fn):
        barrier.wait()
        try:
            results[i] = fn()
        except BaseException as exc:  # collected and asserted on by the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def test_promotion_into_s3_writes_the_release_then_latest(s3_env, inputs, tmp_path):
    root = f"s3://{s3_env}/registry"
    result = _promote(root, inputs, "v1", run_id="run-1")
    target = f"{root}/models/tiny/v1"
    assert result.summary["release_uri"] == target and result.summary["latest_version"] == "v1"
    files = storage.list_files(target)
    assert {"manifest.json", CLAIM, "student/w/a.bin", "student/manifest.json", "evaluation/results.json"} <= set(files)
    release = json.loads(storage.read_bytes(f"{target}/manifest.json"))
    assert release["version"] == "v1" and release["run_id"] == "run-1"
    latest = json.loads(storage.read_bytes(f"{root}/models/tiny/latest.json"))
    assert latest["version"] == "v1" and latest["manifest_uri"] == f"{target}/manifest.json"
    copy = storage.localize(f"{target}/student", tmp_path / "dl")
    read_manifest(copy, verify=True)  # the copy in S3 is complete and intact
    assert production_summary(root, "tiny")["metrics"]["student_perplexity"] == 42.0


def test_repromoting_a_version_in_s3_fails_clearly_and_changes_nothing(s3_env, inputs, tmp_path):
    root = f"s3://{s3_env}/registry"
    _promote(root, inputs, "v1")
    before = {n: storage.read_bytes(f"{root}/models/tiny/v1/{n}") for n in storage.list_files(f"{root}/models/tiny/v1")}
    retrained = {**inputs, "student": _student(tmp_path, "retrained")}
    with pytest.raises(ReleaseExistsError, match=r"v1 already exists as a complete release; .* choose a new version"):
        _promote(root, retrained, "v1")
    after = {n: storage.read_bytes(f"{root}/models/tiny/v1/{n}") for n in storage.list_files(f"{root}/models/tiny/v1")}
    assert after == before


def test_the_s3_server_implements_conditional_create(s3_env):
    uri = f"s3://{s3_env}/x/claim"
    assert storage.create_if_absent(uri, b"first") is True
    assert storage.create_if_absent(uri, b"second") is False
    assert storage.read_bytes(uri) == b"first"


def test_concurrent_promotions_of_one_version_let_exactly_one_win(s3_env, inputs, tmp_path):
    root = f"s3://{s3_env}/registry"
    runs = [{**inputs, "student": _student(tmp_path, f"run-{i}")} for i in range(4)]
    results = _concurrently([lambda i=i: _promote(root, runs[i], "v1", run_id=f"run-{i}") for i in range(4)])
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 3 and all(isinstance(e, ReleaseExistsError) for e in errors), errors
    (winner,) = [r for r in results if not isinstance(r, BaseException)]
    release = json.loads(storage.read_bytes(f"{root}/models/tiny/v1/manifest.json"))
    claim = json.loads(storage.read_bytes(f"{root}/models/tiny/v1/{CLAIM}"))
    assert release["run_id"] == claim["run_id"]  # the release was written by the run that claimed it
    assert winner.summary["version"] == "v1"


@pytest.mark.parametrize("where", ["s3", "local"])
def test_concurrent_promotions_of_different_versions_all_land_and_latest_is_one_complete_release(
    s3_env, inputs, tmp_path, where
):
    root = f"s3://{s3_env}/registry" if where == "s3" else str(tmp_path / "registry")
    versions = [f"v{i}" for i in range(5)]
    runs = {v: {**inputs, "student": _student(tmp_path, v)} for v in versions}
    results = _concurrently([lambda v=v: _promote(root, runs[v], v) for v in versions])
    assert not [r for r in results if isinstance(r, BaseException)], results
    releases = list_releases(root, "tiny")
    assert sorted(r["version"] for r in releases) == versions  # every promotion landed, complete
    latest = json.loads(storage.read_bytes(storage.join(root, "models", "tiny", "latest.json")))
    newest = releases[-1]  # ordered by (created_at, version)
    assert latest["version"] == newest["version"]
    assert json.loads(storage.read_bytes(latest["manifest_uri"]))["version"] == latest["version"]
    assert latest_release(root, "tiny")["version"] == newest["version"]


def test_latest_never_moves_backwards(tmp_path, inputs):
    root = str(tmp_path / "registry")
    _promote(root, inputs, "v2")
    model_root = storage.join(root, "models", "tiny")
    older = {"version": "v1", "manifest_uri": "unused", "created_at": "2000-01-01T00:00:00.000Z"}
    assert update_latest(model_root, older)["version"] == "v2"
    assert json.loads(storage.read_bytes(f"{model_root}/latest.json"))["version"] == "v2"


def test_a_release_without_manifest_is_never_reported_as_latest(s3_env, inputs, tmp_path):
    root = f"s3://{s3_env}/registry"
    model_root = f"{root}/models/tiny"
    assert latest_release(root, "tiny") is None
    assert production_summary(root, "tiny")["status"] == "none"
    _promote(root, inputs, "v1")
    # v2's files landed but its manifest never did (an interrupted promotion) and latest.json was pointed at it.
    storage.write_bytes(f"{model_root}/v2/student/config.json", b"{}")
    dangling = {"version": "v2", "manifest_uri": f"{model_root}/v2/manifest.json", "created_at": "2999-01-01T00:00:00Z"}
    storage.write_bytes(f"{model_root}/latest.json", json.dumps(dangling).encode())
    assert [r["version"] for r in list_releases(root, "tiny")] == ["v1"]
    assert latest_release(root, "tiny")["version"] == "v1"
    assert production_summary(root, "tiny")["version"] == "v1"
    # the next promotion repairs latest.json even though the dangling entry claims to be newer
    _promote(root, {**inputs, "student": _student(tmp_path, "v3")}, "v3")
    assert json.loads(storage.read_bytes(f"{model_root}/latest.json"))["version"] == "v3"
    with pytest.raises(ReleaseExistsError, match="incomplete release"):
        _promote(root, {**inputs, "student": _student(tmp_path, "v2")}, "v2")
