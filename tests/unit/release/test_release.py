"""Promotion into a local release root: layout, lineage, immutability, refusals."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from pathlib import Path

import pytest

from lmforge import storage
from lmforge.artifacts import fingerprint, read_manifest, write_manifest
from lmforge.errors import ArtifactIncompleteError, ConfigError, InputDataError, ReleaseExistsError
from lmforge.release.promote import default_version, promote

MODEL = "tiny"


def _artifact(root: Path, kind: str, files: dict[str, str]) -> Path:
    root.mkdir(parents=True)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    write_manifest(root, kind)
    return root


def _evaluation(root: Path, passed: bool = True) -> Path:
    gate = {"passed": passed, "checks": [{"name": "student_perplexity", "passed": passed, "reason": "r"}]}
    root.mkdir(parents=True)
    (root / "results.json").write_text(json.dumps({"passed": passed, "gate": gate}))
    (root / "report.html").write_text("<html></html>")
    write_manifest(root, "evaluation", metrics={"student_perplexity": 42.0, "passed": float(passed)})
    return root


@pytest.fixture
def inputs(tmp_path) -> dict[str, Path]:
    return {
        "student": _artifact(tmp_path / "in" / "student", "model", {"config.json": "{}", "w/a.bin": "abc"}),
        "int8_qdq": _artifact(tmp_path / "in" / "qdq", "onnx", {"model.onnx": "onnx"}),
        "evaluation": _evaluation(tmp_path / "in" / "evaluation"),
    }


def _promote(tmp_path, inputs, version="v1", **kwargs):
    artifacts = {k: v for k, v in inputs.items() if k != "evaluation"}
    return promote(
        model_name=MODEL,
        release_root=str(tmp_path / "releases"),
        version=version,
        artifacts=artifacts,
        evaluation_dir=inputs["evaluation"],
        **kwargs,
    )


def _files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_promote_copies_artifacts_and_writes_manifest_then_latest(tmp_path, inputs):
    result = _promote(tmp_path, inputs, run_id="run-7")
    target = tmp_path / "releases" / "models" / "tiny" / "v1"
    assert result.summary["release_uri"] == str(target) and result.summary["version"] == "v1"
    assert (target / "student" / "w" / "a.bin").read_text() == "abc"
    assert (target / "int8_qdq" / "model.onnx").read_text() == "onnx"
    assert (target / "evaluation" / "report.html").is_file()
    for name in ("student", "int8_qdq", "evaluation"):
        read_manifest(target / name, verify=True)  # copies are complete and intact

    release = json.loads((target / "manifest.json").read_text())
    assert release["kind"] == "release" and release["version"] == "v1" and release["run_id"] == "run-7"
    student = release["artifacts"]["student"]
    assert student["kind"] == "model"
    assert student["fingerprint"] == fingerprint(read_manifest(inputs["student"]))
    assert student["source_uri"] == str(inputs["student"])
    assert release["evaluation"]["metrics"]["student_perplexity"] == 42.0
    assert release["evaluation"]["gate"]["passed"] is True
    assert release["lmforge_version"]

    latest = json.loads((tmp_path / "releases" / "models" / "tiny" / "latest.json").read_text())
    assert latest["version"] == "v1"
    assert latest["manifest_uri"] == str(target / "manifest.json")
    assert latest["created_at"] == release["created_at"]


def test_repromoting_a_version_is_refused_and_leaves_the_release_intact(tmp_path, inputs):
    _promote(tmp_path, inputs)
    target = tmp_path / "releases" / "models" / "tiny" / "v1"
    before = _files(target)
    (inputs["student"] / "w" / "a.bin").write_text("changed")
    write_manifest(inputs["student"], "model")
    with pytest.raises(ReleaseExistsError, match="already exists as a complete release"):
        _promote(tmp_path, inputs)
    assert _files(target) == before


def test_a_changed_artifact_is_published_as_a_new_version_and_moves_latest(tmp_path, inputs):
    _promote(tmp_path, inputs, version="v1")
    (inputs["student"] / "w" / "a.bin").write_text("retrained")
    write_manifest(inputs["student"], "model")
    result = _promote(tmp_path, inputs, version="v2")
    assert result.summary["status"] == "published" and result.summary["version"] == "v2"
    latest = json.loads((tmp_path / "releases" / "models" / "tiny" / "latest.json").read_text())
    assert latest["version"] == "v2"
    assert (tmp_path / "releases" / "models" / "tiny" / "v2" / "student" / "w" / "a.bin").read_text() == "retrained"


def test_promoting_what_production_already_serves_publishes_nothing_and_burns_no_version(tmp_path, inputs):
    first = _promote(tmp_path, inputs, version="v1")
    registry = tmp_path / "releases"
    before = _files(registry)
    # a scheduled run on unchanged data: the same models, a new evaluation (gated against v1), a new version
    inputs["evaluation"] = _evaluation(tmp_path / "in" / "evaluation-2")
    again = _promote(tmp_path, inputs, version="v2")
    assert again.summary == {
        "status": "unchanged",
        "release_uri": first.summary["release_uri"],
        "version": "v1",
        "manifest_uri": first.summary["manifest_uri"],
        "latest_version": "v1",
    }
    assert _files(registry) == before  # no v2, no claim, latest.json untouched
    (inputs["student"] / "w" / "a.bin").write_text("retrained")
    write_manifest(inputs["student"], "model")
    assert _promote(tmp_path, inputs, version="v2").summary["status"] == "published"  # v2 is still free


def test_a_rerun_that_differs_only_in_timings_and_event_logs_publishes_nothing(tmp_path, inputs):
    """A re-run on unchanged inputs makes bit-identical weights, but its training history (tokens/s), TensorBoard
    event file (named by time, host and pid), report and stats differ: the release it would make is the same one."""

    def train(run: int) -> None:
        shutil.rmtree(inputs["student"] / "tensorboard", ignore_errors=True)
        (inputs["student"] / "tensorboard").mkdir()
        records = {
            "training_history.json": f'{{"tokens_per_sec": [{run}]}}',
            f"tensorboard/events.out.tfevents.{run}": f"t{run}",
            "report.html": f"<p>{run} s</p>",
            "stats.json": f'{{"docs_per_sec": {run}}}',
        }
        for name, text in records.items():
            (inputs["student"] / name).write_text(text)
        write_manifest(inputs["student"], "model")

    train(1)
    first = _promote(tmp_path, inputs, version="v1")
    train(2)
    inputs["evaluation"] = _evaluation(tmp_path / "in" / "evaluation-2")
    again = _promote(tmp_path, inputs, version="v2")
    assert again.summary["status"] == "unchanged" and again.summary["version"] == "v1", again.summary
    assert again.summary["release_uri"] == first.summary["release_uri"]
    (inputs["student"] / "w" / "a.bin").write_text("retrained")  # the weights do count
    write_manifest(inputs["student"], "model")
    assert _promote(tmp_path, inputs, version="v2").summary["status"] == "published"


def test_the_same_files_made_from_other_inputs_are_published(tmp_path, inputs):
    shards = {"uri": "s3://b/shards", "kind": "token-shards", "fingerprint": "a" * 64}
    write_manifest(inputs["student"], "model", inputs={"shards": shards})
    _promote(tmp_path, inputs, version="v1")
    release = json.loads((tmp_path / "releases" / "models" / "tiny" / "v1" / "manifest.json").read_text())
    assert release["artifacts"]["student"]["inputs"] == {"shards": "a" * 64}
    write_manifest(inputs["student"], "model", inputs={"shards": {**shards, "fingerprint": "b" * 64}})
    assert _promote(tmp_path, inputs, version="v2").summary["status"] == "published"


def test_a_different_set_of_artifacts_is_published(tmp_path, inputs):
    _promote(tmp_path, inputs, version="v1")
    del inputs["int8_qdq"]  # e.g. withheld by its accuracy gate this time
    assert _promote(tmp_path, inputs, version="v2").summary["status"] == "published"


def test_an_interrupted_release_is_not_overwritten(tmp_path, inputs):
    partial = tmp_path / "releases" / "models" / "tiny" / "v1" / "student"
    partial.mkdir(parents=True)
    with pytest.raises(ReleaseExistsError, match="incomplete release"):
        _promote(tmp_path, inputs)


def test_artifact_without_manifest_is_refused_before_anything_is_written(tmp_path, inputs):
    bare = tmp_path / "in" / "bare"
    bare.mkdir()
    (bare / "model.onnx").write_text("x")
    with pytest.raises(ArtifactIncompleteError, match="no manifest.json"):
        _promote(tmp_path, {**inputs, "int8_dynamic": bare})
    assert not (tmp_path / "releases").exists()


def test_failed_evaluation_is_refused_unless_explicitly_allowed(tmp_path, inputs):
    failed = {**inputs, "evaluation": _evaluation(tmp_path / "in" / "failed-eval", passed=False)}
    with pytest.raises(InputDataError, match="did not pass the gate"):
        _promote(tmp_path, failed)
    assert not (tmp_path / "releases").exists()
    _promote(tmp_path, failed, require_passed=False)


@pytest.mark.parametrize("version", ["", "-v1", ".hidden", "v1/../x", "v 1", "v1\n", "../v1", "v1:2"])
def test_bad_version_is_rejected(tmp_path, inputs, version):
    with pytest.raises(ConfigError, match="invalid version"):
        _promote(tmp_path, inputs, version=version)
    assert not (tmp_path / "releases").exists()


@pytest.mark.parametrize("name", ["manifest.json", "evaluation", "a/b", ""])
def test_reserved_or_unsafe_artifact_names_are_rejected(tmp_path, inputs, name):
    with pytest.raises(ConfigError):
        promote(
            model_name=MODEL,
            release_root=str(tmp_path / "releases"),
            version="v1",
            artifacts={name: inputs["student"]},
            evaluation_dir=inputs["evaluation"],
        )


def test_default_version_is_a_utc_timestamp():
    assert re.fullmatch(r"v\d{8}-\d{6}", default_version())


def test_an_int8_model_its_accuracy_gate_rejected_is_withheld_from_the_release(tmp_path, inputs):
    rejected = {"accepted": False, "reason": "rejected: held-out perplexity 110 vs FP32 100: delta +10.00%"}
    inputs["int8_qdq"].joinpath("manifest.json").unlink()
    write_manifest(inputs["int8_qdq"], "onnx-model", extra={"quantization": "qdq-int8", "accuracy_gate": rejected})
    _promote(tmp_path, inputs)
    target = tmp_path / "releases" / "models" / "tiny" / "v1"
    release = json.loads((target / "manifest.json").read_text())
    assert set(release["artifacts"]) == {"student"} and not (target / "int8_qdq").exists()
    assert release["withheld"] == {"int8_qdq": rejected["reason"]}


def test_a_release_of_only_rejected_models_is_refused(tmp_path, inputs):
    gate = {"accepted": False, "reason": "rejected: r"}
    inputs["int8_qdq"].joinpath("manifest.json").unlink()
    write_manifest(inputs["int8_qdq"], "onnx-model", extra={"quantization": "qdq-int8", "accuracy_gate": gate})
    del inputs["student"]
    with pytest.raises(InputDataError, match=r"every artifact failed its accuracy gate \(int8_qdq\)"):
        _promote(tmp_path, inputs)
    assert not (tmp_path / "releases" / "models" / "tiny" / "v1").exists()


def _promote_in_thread(tmp_path, inputs, results: list) -> threading.Thread:
    def target() -> None:
        try:
            results.append(_promote(tmp_path, inputs).summary["status"])
        except ReleaseExistsError as exc:
            results.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    return thread


def test_a_promotion_meeting_another_still_copying_is_told_it_is_in_progress(tmp_path, inputs, monkeypatch):
    copying, finish = threading.Event(), threading.Event()
    copy_tree = storage.copy_tree

    def held_copy(src, dst, **kwargs):
        copying.set()
        assert finish.wait(60)
        return copy_tree(src, dst, **kwargs)

    monkeypatch.setattr(storage, "copy_tree", held_copy)
    results: list = []
    first = _promote_in_thread(tmp_path, inputs, results)
    assert copying.wait(60)
    with pytest.raises(ReleaseExistsError, match=r"v1 is claimed by another promotion \(since .*\): it is in progress"):
        _promote(tmp_path, inputs)
    finish.set()
    first.join()
    assert results == ["published"]


def test_a_promotion_meeting_another_mid_claim_is_not_told_of_an_interrupted_one(tmp_path, inputs, monkeypatch):
    # The other promotion has created the version folder and its claim's temporary file, not yet the claim.
    in_window, resume = threading.Event(), threading.Event()
    link = os.link

    def link_held_for_the_first_claim(src, dst, *args, **kwargs):
        if str(dst).endswith(".promotion.json") and not in_window.is_set():
            in_window.set()
            assert resume.wait(60)
        return link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", link_held_for_the_first_claim)
    results: list = []
    first = _promote_in_thread(tmp_path, inputs, results)
    assert in_window.wait(60)
    results.append(_promote(tmp_path, inputs).summary["status"])  # the claim is free: this one takes it
    resume.set()
    first.join()
    [refused] = [r for r in results if isinstance(r, ReleaseExistsError)]
    assert results.count("published") == 1
    assert "already exists as a complete release" in str(refused) and "interrupted" not in str(refused)
