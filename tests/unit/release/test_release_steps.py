"""promote's steps alone: the gate baseline it re-checks and the names it refuses."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lmforge.errors import GateBaselineMovedError, InputDataError
from lmforge.release.promote import _check_release_names, _gate_baseline
from lmforge.tracking.promotion import MLFLOW_SOURCE

EVALUATION = Path("/runs/evaluation")


def test_a_baseline_read_from_the_mlflow_alias_is_left_to_the_caller():
    baseline = {"status": "found", "version": "v1", "fingerprint": "f", "source": MLFLOW_SOURCE}
    assert _gate_baseline(baseline, None, EVALUATION) is None


def test_an_evaluation_without_a_baseline_is_warned_of_and_not_rechecked(caplog):
    with caplog.at_level(logging.WARNING, logger="lmforge.promote"):
        assert _gate_baseline(None, None, EVALUATION) is None
    assert caplog.messages == [
        f"{EVALUATION} records no gate baseline (production); latest.json is moved without re-checking it"
    ]


def test_a_baseline_that_is_still_production_is_kept_for_latest_json():
    baseline = {"status": "none", "reason": "no release yet"}
    assert _gate_baseline(baseline, None, EVALUATION) is baseline


def test_a_baseline_that_is_no_longer_production_is_stale():
    baseline = {"status": "found", "version": "v1", "fingerprint": "0123456789abcdef"}
    with pytest.raises(GateBaselineMovedError, match=r"^evaluation /runs/evaluation is stale: .* no complete release"):
        _gate_baseline(baseline, None, EVALUATION)


def test_a_promotion_of_no_artifacts_is_refused():
    with pytest.raises(InputDataError, match=r"^promote: no artifacts given$"):
        _check_release_names("tiny", "v1", {})
