"""The promotion gate: every check, passing, failing and with missing values."""

from __future__ import annotations

import pytest

from lmforge.config import GateConfig
from lmforge.evaluate.gate import check_gate

CFG = GateConfig(max_student_perplexity=100.0, max_int8_perplexity_delta=0.05, max_latency_ms=50.0)


def results(student=80.0, fp32=60.0, int8=62.0, p99=40.0, served="int8_dynamic"):
    models = {}
    if student is not None:
        models["student"] = {"perplexity": student}
    if fp32 is not None:
        models["onnx_fp32"] = {"perplexity": fp32}
    if int8 is not None:
        models["int8_dynamic"] = {"perplexity": int8, "p99_ms": p99}
    return {"models": models, "served_model": served}


def check(decision, name):
    (found,) = [c for c in decision.checks if c.name == name]
    return found


def test_all_checks_pass_within_thresholds():
    decision = check_gate(CFG, results())
    assert decision.passed
    assert [c.name for c in decision.checks] == [
        "student_perplexity",
        "int8_perplexity_delta",
        "served_p99_latency_ms",
    ]
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
    ],
)
def test_a_missing_or_invalid_value_fails_its_check_with_a_reason(overrides, name, reason):
    decision = check_gate(CFG, results(**overrides))
    got = check(decision, name)
    assert not got.passed
    assert got.value is None
    assert reason in got.reason
    assert not decision.passed


def test_empty_results_fail_every_check():
    decision = check_gate(CFG, {})
    assert not decision.passed
    assert len(decision.checks) == 3 and not any(c.passed for c in decision.checks)


def test_decision_serializes_to_plain_json_types():
    data = check_gate(CFG, results()).to_dict()
    assert data["passed"] is True
    assert set(data["checks"][0]) == {"name", "value", "threshold", "passed", "reason"}
