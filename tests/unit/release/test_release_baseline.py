"""The gate's baseline is re-checked at promotion: a stale evaluation cannot become latest (docs/security.md, M5)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from lmforge import storage
from lmforge.artifacts import write_manifest
from lmforge.errors import GateBaselineMovedError
from lmforge.release.catalog import CLAIM, latest_release, list_releases, production_summary
from lmforge.release.promote import promote

MODEL = "tiny"


def _student(root: Path) -> Path:
    """A student model of its own (named by ``root``): each run trained another one."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"trained_by": root.name}))
    write_manifest(root, "model")
    return root


def _evaluate(root: Path, registry: str, bits_per_byte: float) -> Path:
    """What ``evaluate`` writes, reduced to what promote reads: the gate passed against today's production."""
    root.mkdir(parents=True)
    production = production_summary(registry, "tiny")  # the baseline evaluate records
    results = {"passed": True, "gate": {"passed": True, "checks": []}, "production": production}
    (root / "results.json").write_text(json.dumps(results))
    write_manifest(root, "evaluation", metrics={"student_bits_per_byte": bits_per_byte})
    return root


def _promote(registry: str, tmp_path: Path, version: str, evaluation: Path):
    student = _student(tmp_path / "in" / evaluation.name)
    return promote(
        model_name=MODEL,
        release_root=registry,
        version=version,
        artifacts={"student": student},
        evaluation_dir=evaluation,
    )


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def registry(request, tmp_path) -> str:
    if request.param == "s3":
        return f"s3://{request.getfixturevalue('s3_env')}/registry"
    return str(tmp_path / "registry")


def test_two_runs_gated_against_the_same_release_the_worse_one_finishing_last_cannot_become_latest(registry, tmp_path):
    _promote(registry, tmp_path, "v1", _evaluate(tmp_path / "eval-v1", registry, 1.00))
    v1 = production_summary(registry, "tiny")
    better = _evaluate(tmp_path / "eval-better", registry, 0.90)  # both gated against v1
    worse = _evaluate(tmp_path / "eval-worse", registry, 0.99)
    assert json.loads((worse / "results.json").read_text())["production"]["fingerprint"] == v1["fingerprint"]

    _promote(registry, tmp_path, "v2", better)
    with pytest.raises(GateBaselineMovedError, match=r"compared it with production v1 .*latest release is now v2"):
        _promote(registry, tmp_path, "v3", worse)

    assert latest_release(registry, "tiny")["version"] == "v2"
    assert [r["version"] for r in list_releases(registry, "tiny")] == ["v1", "v2"]
    assert not storage.exists(storage.join(registry, "models", "tiny", "v3", CLAIM))  # v3 was not burned
    again = _evaluate(tmp_path / "eval-worse-again", registry, 0.99)  # re-evaluated against v2 (and passing)
    assert _promote(registry, tmp_path, "v3", again).summary["latest_version"] == "v3"


def test_a_release_recreated_under_the_same_version_is_a_moved_baseline(registry, tmp_path):
    _promote(registry, tmp_path, "v1", _evaluate(tmp_path / "eval-v1", registry, 1.00))
    stale = _evaluate(tmp_path / "eval-stale", registry, 0.95)
    # someone with write access to the registry replaces v1 by another release of the same version
    uri = storage.join(registry, "models", "tiny", "v1", "manifest.json")
    manifest = json.loads(storage.read_bytes(uri))
    storage.write_bytes(uri, json.dumps({**manifest, "run_id": "other"}).encode())
    with pytest.raises(GateBaselineMovedError, match="is now v1 "):
        _promote(registry, tmp_path, "v2", stale)


def test_racing_promotions_against_one_baseline_move_latest_once(registry, tmp_path):
    _promote(registry, tmp_path, "v1", _evaluate(tmp_path / "eval-v1", registry, 1.00))
    evaluations = {f"v{i}": _evaluate(tmp_path / f"eval-{i}", registry, 1.0 - i / 100) for i in range(2, 6)}
    students = {version: _student(tmp_path / "in" / version) for version in evaluations}
    outcomes: dict[str, object] = {}
    start = threading.Barrier(len(evaluations))

    def run(version: str) -> None:
        start.wait()
        try:
            outcomes[version] = promote(
                model_name=MODEL,
                release_root=registry,
                version=version,
                artifacts={"student": students[version]},
                evaluation_dir=evaluations[version],
            )
        except GateBaselineMovedError as exc:
            outcomes[version] = exc

    threads = [threading.Thread(target=run, args=(v,)) for v in evaluations]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    landed = [v for v, outcome in outcomes.items() if not isinstance(outcome, Exception)]
    assert len(landed) == 1, outcomes
    assert latest_release(registry, "tiny")["version"] == landed[0]


def test_a_rerun_on_unchanged_data_returns_production_instead_of_publishing_a_copy(registry, tmp_path):
    student = _student(tmp_path / "in" / "student")
    first = promote(
        model_name=MODEL,
        release_root=registry,
        version="v1",
        artifacts={"student": student},
        evaluation_dir=_evaluate(tmp_path / "eval-1", registry, 1.00),
    )
    rerun = _evaluate(tmp_path / "eval-2", registry, 1.00)  # the next scheduled run, gated against v1
    again = promote(
        model_name=MODEL, release_root=registry, version="v2", artifacts={"student": student}, evaluation_dir=rerun
    )
    assert again.summary["status"] == "unchanged" and again.summary["release_uri"] == first.summary["release_uri"]
    assert [r["version"] for r in list_releases(registry, "tiny")] == ["v1"]
    assert not storage.exists(storage.join(registry, "models", "tiny", "v2"))
    assert latest_release(registry, "tiny")["version"] == "v1"
