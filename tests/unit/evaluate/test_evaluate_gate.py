"""The promotion gate: every check, passing, failing and with missing values."""

from __future__ import annotations

import pytest

from lmforge.config import GATE_CHECKS, GateConfig
from lmforge.evaluate.gate import check_gate

CFG = GateConfig(
    max_student_perplexity=100.0,
    max_int8_perplexity_delta=0.05,
    max_latency_ms=50.0,
    min_student_exact_match=0.2,
    max_bits_per_byte_regression=0.02,
    max_exact_match_regression=0.05,
)
NA_WITHOUT_INPUTS = {"teacher_forgetting", "student_forgetting", "data_retention"}  # no base / no cleaning stats
_ABSENT = object()


def results(
    student=80.0,
    fp32=60.0,
    int8=62.0,
    p99=40.0,
    served="int8_dynamic",
    em=0.5,
    bpb=2.0,
    prod_bpb=2.0,
    prod_em=0.5,
    production="found",
):
    # what the relative checks read, at values that pass them (tests of those checks: test_evaluate_gate_relative.py)
    models = {
        "base": {"bits_per_byte": 2.0},
        "teacher": {"bits_per_byte": 2.1, "f1": 0.5, "answer_loss": 2.0},
    }
    if student is not None:
        models["student"] = {
            "perplexity": student,
            "bits_per_byte": bpb,
            "exact_match": em,
            "f1": 0.45,
            "empty_answer_fraction": 0.1,
            "answer_loss": 2.1,
        }
        models["student"] = {k: v for k, v in models["student"].items() if v is not _ABSENT}
    if fp32 is not None:
        models["onnx_fp32"] = {"perplexity": fp32}
    if int8 is not None:
        models["int8_dynamic"] = {"perplexity": int8, "p99_ms": p99, "answer_loss": 2.1}
    prod_metrics = {
        k: v for k, v in (("student_bits_per_byte", prod_bpb), ("student_exact_match", prod_em)) if v is not _ABSENT
    }
    prod = {
        "found": {"status": "found", "version": "v1", "metrics": prod_metrics},
        "none": {"status": "none", "reason": "no release of 'tiny' yet"},
        None: None,
    }[production]
    clean = {"docs_in": 100, "docs_out": 90, "bytes_in": 10_000, "bytes_out": 9_000}
    out = {"models": models, "served_model": served, "data": {"clean": {"metrics": clean}}}
    if prod is not None:
        out["production"] = prod
    return out


def check(decision, name):
    (found,) = [c for c in decision.checks if c.name == name]
    return found


def test_all_checks_pass_within_thresholds():
    decision = check_gate(CFG, results())
    assert decision.passed
    assert tuple(c.name for c in decision.checks) == GATE_CHECKS
    assert all(c.passed for c in decision.checks)
    assert check(decision, "int8_perplexity_delta").value == pytest.approx(2 / 60)


@pytest.mark.parametrize(
    ("overrides", "name", "value", "reason"),
    [
        ({"student": 100.0}, "student_perplexity", 100.0, "ok"),  # the threshold itself passes
        ({"student": 100.01}, "student_perplexity", 100.01, "too high"),
        ({"int8": 63.0}, "int8_perplexity_delta", 0.05, "ok"),
        ({"int8": 63.1}, "int8_perplexity_delta", 3.1 / 60, "too high"),
        ({"int8": 50.0}, "int8_perplexity_delta", -10 / 60, "ok"),  # INT8 better than FP32
        ({"p99": 50.0}, "served_p99_latency_ms", 50.0, "ok"),
        ({"p99": 50.5}, "served_p99_latency_ms", 50.5, "too high"),
        ({"em": 0.2, "prod_em": 0.2}, "student_exact_match", 0.2, "ok"),
        ({"em": 0.19, "prod_em": 0.19}, "student_exact_match", 0.19, "too low"),
        ({"bpb": 2.03125}, "bits_per_byte_vs_production", 1 / 64, "ok"),
        ({"bpb": 2.05}, "bits_per_byte_vs_production", 0.025, "too high"),
        ({"bpb": 1.5}, "bits_per_byte_vs_production", -0.25, "ok"),  # better than production
        ({"em": 0.45}, "exact_match_vs_production", 0.05, "ok"),
        ({"em": 0.44}, "exact_match_vs_production", 0.06, "too high"),
        ({"em": 0.9}, "exact_match_vs_production", -0.4, "ok"),
    ],
)
def test_each_check_compares_value_with_threshold(overrides, name, value, reason):
    decision = check_gate(CFG, results(**overrides))
    got = check(decision, name)
    assert got.value == pytest.approx(value)
    assert got.passed == (reason == "ok")
    assert reason in got.reason
    assert decision.passed == got.passed


@pytest.mark.parametrize(
    ("overrides", "name", "reason"),
    [
        ({"student": None}, "student_perplexity", "'student' was not evaluated"),
        ({"fp32": None}, "int8_perplexity_delta", "'onnx_fp32' was not evaluated"),
        ({"int8": None}, "int8_perplexity_delta", "'int8_dynamic' was not evaluated"),
        ({"served": None}, "served_p99_latency_ms", "no served model"),
        ({"served": "tensorrt"}, "served_p99_latency_ms", "'tensorrt' was not evaluated"),
        ({"p99": None}, "served_p99_latency_ms", "int8_dynamic.p99_ms is missing"),
        ({"p99": float("nan")}, "served_p99_latency_ms", "not a finite number"),
        ({"student": float("inf")}, "student_perplexity", "not a finite number"),
        ({"student": "80"}, "student_perplexity", "not a finite number"),
        ({"fp32": 0.0}, "int8_perplexity_delta", "not positive"),
        ({"em": None}, "student_exact_match", "student.exact_match is missing"),
        ({"student": None}, "student_exact_match", "'student' was not evaluated"),
        ({"bpb": None}, "bits_per_byte_vs_production", "student.bits_per_byte is missing"),
        ({"prod_bpb": _ABSENT}, "bits_per_byte_vs_production", "production v1 student_bits_per_byte is missing"),
        ({"prod_bpb": 0.0}, "bits_per_byte_vs_production", "not positive"),
        ({"prod_em": float("nan")}, "exact_match_vs_production", "not a finite number"),
        ({"em": _ABSENT}, "exact_match_vs_production", "student.exact_match is missing"),
        ({"production": None}, "bits_per_byte_vs_production", "not looked up"),
        ({"production": None}, "exact_match_vs_production", "not looked up"),
    ],
)
def test_a_missing_or_invalid_value_fails_its_check_with_a_reason(overrides, name, reason):
    decision = check_gate(CFG, results(**overrides))
    got = check(decision, name)
    assert not got.passed
    assert got.value is None
    assert reason in got.reason
    assert not decision.passed


def test_empty_results_fail_every_check_that_has_something_to_measure():
    decision = check_gate(CFG, {})
    assert not decision.passed
    assert len(decision.checks) == len(GATE_CHECKS)
    assert not any(c.passed for c in decision.checks)
    assert {c.name for c in decision.checks if c.status == "n/a"} == NA_WITHOUT_INPUTS
    assert set(decision.failed) == set(GATE_CHECKS) - NA_WITHOUT_INPUTS


def test_no_production_release_yet_makes_the_comparisons_n_a_with_a_reason():
    decision = check_gate(CFG, results(production="none", bpb=2.4, em=0.2))
    assert decision.passed
    for name in ("bits_per_byte_vs_production", "exact_match_vs_production"):
        got = check(decision, name)
        assert got.status == "n/a" and not got.passed and got.value is None
        assert got.reason == "no release of 'tiny' yet: nothing to compare with (first release)"


@pytest.mark.parametrize(
    ("setting", "name"),
    [
        ("min_student_exact_match", "student_exact_match"),
        ("max_bits_per_byte_regression", "bits_per_byte_vs_production"),
        ("max_exact_match_regression", "exact_match_vs_production"),
    ],
)
def test_a_check_configured_as_null_is_disabled_and_says_so(setting, name):
    cfg = CFG.model_copy(update={setting: None})
    decision = check_gate(cfg, results(em=None, bpb=None, production="found"))
    got = check(decision, name)
    assert got.status == "off" and not got.passed and got.threshold is None
    assert got.reason == f"disabled ({setting} is null)"


def test_a_candidate_worse_than_production_fails_the_gate_although_it_meets_the_absolute_thresholds():
    decision = check_gate(CFG, results(bpb=2.5, em=0.3, prod_bpb=2.0, prod_em=0.6))
    assert not decision.passed
    failed = {c.name: c.reason for c in decision.checks if not c.passed}
    assert set(failed) == {"bits_per_byte_vs_production", "exact_match_vs_production"}
    assert "vs production v1" in failed["bits_per_byte_vs_production"]


def test_decision_serializes_to_plain_json_types():
    data = check_gate(CFG, results()).to_dict()
    assert data["passed"] is True
    assert set(data["checks"][0]) == {"name", "value", "threshold", "status", "passed", "reason", "warning"}
    assert data["warnings"] == [] and data["not_applicable"] == [] and data["failed"] == []


def test_int8_rejected_by_the_quantize_gate_falls_back_instead_of_failing():
    from lmforge.config import GateConfig
    from lmforge.contracts import served_model
    from lmforge.evaluate.gate import check_int8_delta

    models = {
        "onnx_fp32": {"perplexity": 100.0, "p99_ms": 5.0},
        "int8_dynamic": {"perplexity": 150.0, "p99_ms": 2.0, "accepted": False, "gate_reason": "ppl +50% > 2%"},
    }
    check = check_int8_delta(GateConfig(), {"models": models})
    assert check.status == "n/a" and "falls back to FP32" in check.reason and "ppl +50%" in check.reason
    assert served_model(models) == "onnx_fp32"
    models["int8_dynamic"]["accepted"] = True
    assert served_model(models) == "int8_dynamic"
    assert not check_int8_delta(GateConfig(), {"models": models}).passed
