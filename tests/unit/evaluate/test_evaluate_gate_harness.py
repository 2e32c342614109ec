"""The gate's harness checks without running the harness: n/a for a task no item of which fit the context, in each
of the three forms, and the sign of a lower-is-better metric's rise."""

from __future__ import annotations

import pytest

from lmforge.config import GateConfig
from lmforge.evaluate.gate import NOT_APPLICABLE, check_harness
from lmforge.evaluate.harness import flat_metrics

KEY = "harness.cloze.perplexity"
ALL_FORMS = {"min": 500.0, "max_drop_vs_teacher": 0.2, "max_drop_vs_production": 5.0}
SKIPPED = {"skipped": 3, "documents": 3, "context": 32}


def _results(student: dict, teacher: dict, production: float | None, skipped: dict | None = None) -> dict:
    harness = {
        "tasks": {"cloze": {"higher_is_better": {"perplexity": False}}},
        "scores": {"student": {"cloze": student}, "teacher": {"cloze": teacher}},
        "skipped": skipped or {},
    }
    found = {"status": "found", "version": "v1", "metrics": {f"student_{KEY}": production}}
    return {
        "models": flat_metrics(harness),
        "harness": harness,
        "production": found if production is not None else {"status": "none", "reason": "no production release"},
    }


def _checks(results: dict) -> dict:
    return {c.name: c for c in check_harness(GateConfig(harness={KEY: ALL_FORMS}), results)}


def test_every_form_is_n_a_when_no_item_of_the_task_fit_the_context():
    checks = _checks(_results({}, {"perplexity": 100.0}, production=100.0, skipped={"student": {"cloze": SKIPPED}}))
    assert list(checks) == [KEY, f"{KEY}_vs_teacher", f"{KEY}_vs_production"]
    note = "student cloze: 3 of 3 items skipped: continuation longer than the model's context of 32 tokens"
    for check in checks.values():
        assert check.status == NOT_APPLICABLE and check.value is None
        assert check.reason == f"{note}: nothing to check"
    assert [c.threshold for c in checks.values()] == [500.0, 0.2, 5.0]


def test_a_teacher_that_fit_no_item_makes_only_the_teacher_form_n_a():
    skipped = {"teacher": {"cloze": SKIPPED}}
    checks = _checks(_results({"perplexity": 400.0}, {}, production=None, skipped=skipped))
    assert checks[KEY].passed
    assert checks[f"{KEY}_vs_teacher"].status == NOT_APPLICABLE
    assert checks[f"{KEY}_vs_teacher"].reason.startswith("teacher cloze: 3 of 3 items skipped")


def test_without_a_production_release_the_production_form_says_so_before_any_skip():
    checks = _checks(_results({}, {"perplexity": 100.0}, production=None, skipped={"student": {"cloze": SKIPPED}}))
    production = checks[f"{KEY}_vs_production"]
    assert production.status == NOT_APPLICABLE
    assert production.reason == "no production release: nothing to compare with (first release)"


def test_a_lower_is_better_metric_is_checked_for_its_rise_against_teacher_and_production():
    checks = _checks(_results({"perplexity": 110.0}, {"perplexity": 100.0}, production=104.0))
    teacher, production = checks[f"{KEY}_vs_teacher"], checks[f"{KEY}_vs_production"]
    assert teacher.value == pytest.approx(0.1) and teacher.passed
    assert teacher.reason.startswith("student harness.cloze.perplexity rise vs teacher (fraction of teacher's) 0.1 ≤")
    assert production.value == pytest.approx(6.0) and not production.passed
    assert production.reason == "student harness.cloze.perplexity rise vs production v1 6 > 5: too high"
