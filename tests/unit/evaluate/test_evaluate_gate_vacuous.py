"""Gate checks whose comparison says nothing are n/a with the reason, never PASS and never counted as passed."""

from __future__ import annotations

import pytest

from lmforge.config import GATE_CHECKS, GateConfig
from lmforge.errors import ConfigError
from lmforge.evaluate.gate import check_gate, check_mark, headline, headline_lines

from .test_evaluate_gate_relative import check, results


def demo_like(**overrides):
    """The demo's vacuous pair: exact match 0 against a threshold of 0, and a teacher whose F1 is 0."""
    data = results(**overrides)
    data["models"]["student"]["exact_match"] = 0.0
    data["production"] = {"status": "found", "version": "v1", "metrics": {"student_exact_match": 0.0}}
    data["production"]["metrics"]["student_bits_per_byte"] = 2.3
    return data


def test_exact_match_0_against_a_threshold_of_0_is_n_a_not_pass():
    decision = check_gate(GateConfig(), demo_like())
    got = check(decision, "student_exact_match")
    assert got.status == "n/a" and not got.passed and got.value == 0.0
    assert "min_student_exact_match is 0, which every exact match meets" in got.reason
    assert check_mark(decision.to_dict()["checks"][3]) == "n/a"


def test_f1_vs_a_teacher_with_f1_0_is_n_a_not_pass():
    got = check(check_gate(GateConfig(), results(teacher_f1=0.0, student_f1=0.0)), "f1_vs_teacher")
    assert got.status == "n/a" and not got.passed and got.value is None
    assert got.reason == "the teacher's F1 is 0: there is no F1 to lose"


def test_exact_match_vs_a_production_release_with_exact_match_0_is_n_a():
    got = check(check_gate(GateConfig(), demo_like()), "exact_match_vs_production")
    assert got.status == "n/a" and got.reason == "production v1 exact match is 0: there is none to lose"


def test_n_a_checks_are_not_counted_as_passed_and_do_not_stop_a_promotion_unless_required():
    data = demo_like(teacher_f1=0.0, student_f1=0.0)
    decision = check_gate(GateConfig(), data)
    assert decision.passed and decision.failed == []
    vacuous = {"student_exact_match", "f1_vs_teacher", "exact_match_vs_production"}
    assert vacuous <= set(decision.not_applicable)
    assert sum(c.passed for c in decision.checks) == len(GATE_CHECKS) - len(decision.not_applicable)
    strict = check_gate(GateConfig(required=["f1_vs_teacher"]), data)
    assert not strict.passed and strict.failed == ["f1_vs_teacher"]
    data["gate"] = decision.to_dict()
    lines = headline_lines(headline(data))
    assert f"gate checks: 9 PASS, 0 FAIL, {len(decision.not_applicable)} n/a (not counted as passed), 0 off" in lines
    assert "n/a f1_vs_teacher: the teacher's F1 is 0: there is no F1 to lose" in lines


def confident(data, text_tokens=20_000, docs=30, prompts=24):
    data["confidence"] = {
        "text": {
            "low": text_tokens < 10_000 or docs < 10,
            "note": f"low confidence: {text_tokens:,} tokens / {docs} documents",
        },
        "qa": {"low": prompts < 20, "note": f"low confidence: {prompts} prompts"},
    }
    return data


def test_a_pass_on_a_held_out_set_below_its_minimum_is_n_a_and_a_fail_still_fails():
    data = confident(results(), text_tokens=4_124, docs=3)
    decision = check_gate(GateConfig(), data)
    for name in ("student_perplexity", "teacher_forgetting", "student_forgetting"):
        got = check(decision, name)
        assert got.status == "n/a" and got.reason.startswith("low confidence: 4,124 tokens / 3 documents, too little")
    assert check(decision, "f1_vs_teacher").status == "pass"  # the Q&A set is large enough
    assert check(decision, "served_p99_latency_ms").status == "pass"  # rests on no held-out set
    bad = check(check_gate(GateConfig(), confident(results(teacher_bpb=2.6), 4_124, 3)), "teacher_forgetting")
    assert bad.status == "fail" and bad.reason.endswith("too high (low confidence: 4,124 tokens / 3 documents)")
    few_prompts = check_gate(GateConfig(), confident(results(), prompts=5))
    assert check(few_prompts, "f1_vs_teacher").status == "n/a" and check(few_prompts, "student_perplexity").passed


def test_every_gate_check_has_a_name_the_config_knows_and_required_refuses_others():
    assert tuple(c.name for c in check_gate(GateConfig(), {}).checks) == GATE_CHECKS
    with pytest.raises(ConfigError, match="unknown gate check 'f1_vs_teachr' \\(did you mean 'f1_vs_teacher'"):
        from lmforge.config import validate_config

        validate_config(GateConfig, {"required": ["f1_vs_teachr"]})
