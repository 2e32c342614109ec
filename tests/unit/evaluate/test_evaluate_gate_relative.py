"""The gate's relative checks: the student against the teacher, forgetting against the base, data retention."""

from __future__ import annotations

import pytest

from lmforge.config import GateConfig
from lmforge.evaluate.gate import check_gate, headline, headline_lines


def results(
    *,
    base_bpb=2.0,
    teacher_bpb=2.2,
    student_bpb=2.1,
    teacher_loss=2.0,
    student_loss=2.2,
    served_loss=2.3,
    teacher_f1=0.4,
    student_f1=0.3,
    empty=0.1,
    served_empty=None,
    clean=(100, 80, 10_000, 9_000),
    served="int8_dynamic",
):
    models = {
        "base": {"bits_per_byte": base_bpb},
        "teacher": {"bits_per_byte": teacher_bpb, "answer_loss": teacher_loss, "f1": teacher_f1},
        "student": {
            "perplexity": 50.0,
            "bits_per_byte": student_bpb,
            "answer_loss": student_loss,
            "f1": student_f1,
            "exact_match": 0.1,
            "empty_answer_fraction": empty,
        },
        "onnx_fp32": {"perplexity": 50.0},
        "int8_dynamic": {"perplexity": 50.5, "p99_ms": 3.0, "answer_loss": served_loss},
    }
    if served_empty is not None:  # the served model generated (its ONNX KV-cache decoder)
        models["int8_dynamic"]["empty_answer_fraction"] = served_empty
    if base_bpb is None:
        del models["base"]
    out = {
        "models": models,
        "served_model": served,
        "production": {"status": "none", "reason": "no release yet"},
    }
    if clean is not None:
        docs_in, docs_out, bytes_in, bytes_out = clean
        metrics = {"docs_in": docs_in, "docs_out": docs_out, "bytes_in": bytes_in, "bytes_out": bytes_out}
        out["data"] = {"clean": {"metrics": metrics}}
    return out


def check(decision, name):
    (found,) = [c for c in decision.checks if c.name == name]
    return found


def test_a_reasonable_student_passes_every_relative_check_with_the_defaults():
    decision = check_gate(GateConfig(), results())
    assert decision.passed, [c.reason for c in decision.checks if not c.passed]
    assert check(decision, "answer_loss_vs_teacher").value == pytest.approx(0.15)  # the served (INT8) model's
    assert check(decision, "f1_vs_teacher").value == pytest.approx(0.25)
    assert check(decision, "teacher_forgetting").value == pytest.approx(0.1)
    assert check(decision, "data_retention").value == pytest.approx(0.8) and decision.warnings == []


def test_a_model_that_answers_nothing_fails_with_the_defaults_naming_the_checks():
    silent = results(student_f1=0.0, empty=1.0, student_loss=4.0, served_loss=4.1)
    decision = check_gate(GateConfig(), silent)
    failed = set(decision.failed)
    assert not decision.passed
    assert failed == {"answer_loss_vs_teacher", "f1_vs_teacher", "served_empty_answers"}
    assert "share of empty student answers 1 > 0.5: too high" in check(decision, "served_empty_answers").reason


def test_the_served_models_own_empty_answers_are_the_headlines_when_it_generated():
    head = headline(results(empty=0.1, served_empty=0.3))
    assert head["empty_answer_model"] == "int8_dynamic" and head["empty_answer_fraction"] == 0.3
    assert "answered with an empty string (int8_dynamic)" in headline_lines(head)[0]
    assert headline(results(empty=0.1))["empty_answer_model"] == "student"  # it could not: the student's stand


@pytest.mark.parametrize(
    ("overrides", "name", "value", "passed"),
    [
        ({"served_loss": 2.5}, "answer_loss_vs_teacher", 0.25, True),
        ({"served_loss": 2.51}, "answer_loss_vs_teacher", 0.255, False),
        ({"served": "onnx_fp32", "student_loss": 2.6}, "answer_loss_vs_teacher", 0.3, False),  # no served figure
        ({"student_f1": 0.2}, "f1_vs_teacher", 0.5, True),
        ({"student_f1": 0.19}, "f1_vs_teacher", 0.525, False),
        ({"student_f1": 0.6}, "f1_vs_teacher", -0.5, True),
        ({"empty": 0.5}, "served_empty_answers", 0.5, True),
        ({"empty": 0.55}, "served_empty_answers", 0.55, False),
        ({"empty": 0.1, "served_empty": 0.6}, "served_empty_answers", 0.6, False),  # the served model's own
        ({"empty": 0.9, "served_empty": 0.2}, "served_empty_answers", 0.2, True),
        ({"teacher_bpb": 2.5}, "teacher_forgetting", 0.25, True),
        ({"teacher_bpb": 2.6}, "teacher_forgetting", 0.3, False),
        ({"student_bpb": 2.6}, "student_forgetting", 0.3, False),
        ({"student_bpb": 1.8}, "student_forgetting", -0.1, True),
    ],
)
def test_each_relative_check_compares_with_its_reference(overrides, name, value, passed):
    decision = check_gate(GateConfig(), results(**overrides))
    got = check(decision, name)
    assert got.value == pytest.approx(value) and got.passed is passed


def test_without_a_teacher_figure_the_comparison_fails_with_the_reason():
    data = results()
    del data["models"]["teacher"]["answer_loss"]
    got = check(check_gate(GateConfig(), data), "answer_loss_vs_teacher")
    assert not got.passed and "teacher.answer_loss is missing" in got.reason


def test_without_a_base_model_forgetting_is_not_measured_and_says_so():
    decision = check_gate(GateConfig(), results(base_bpb=None))
    for name in ("teacher_forgetting", "student_forgetting"):
        got = check(decision, name)
        assert got.status == "n/a" and got.value is None and "no base model evaluated" in got.reason


def test_low_retention_fails_by_default_warns_below_the_warning_level_and_is_n_a_without_a_threshold():
    low = results(clean=(710, 120, 5_000_000, 1_100_000))  # cleaning kept 17 % of the documents
    decision = check_gate(GateConfig(), low)
    got = check(decision, "data_retention")
    assert not decision.passed and got.status == "fail" and got.value == pytest.approx(120 / 710)
    assert "16.9% < 25.0%: too low" in got.reason
    assert decision.warnings == [
        "cleaning kept 120 of 710 documents (16.9%) and 22.0% of the bytes: below the 50% warning level; "
        "check the cleaning rules"
    ]
    middling = check(check_gate(GateConfig(), results(clean=(710, 300, 5_000_000, 2_000_000))), "data_retention")
    assert middling.status == "pass" and middling.warning is not None  # 40 %: passes, warns
    no_threshold = check_gate(GateConfig(min_retention=None), low)
    got = check(no_threshold, "data_retention")
    assert got.status == "n/a" and not got.passed and "no failing threshold (min_retention is null)" in got.reason
    assert no_threshold.passed and "data_retention" in no_threshold.not_applicable
    assert check(check_gate(GateConfig(retention_warning=None), low), "data_retention").warning is None


def test_without_cleaning_statistics_retention_is_not_measured():
    got = check(check_gate(GateConfig(), results(clean=None)), "data_retention")
    assert got.status == "n/a" and got.value is None and "retention not measured" in got.reason


@pytest.mark.parametrize(
    ("name", "setting"),
    [
        ("answer_loss_vs_teacher", "max_answer_loss_increase"),
        ("f1_vs_teacher", "max_f1_drop"),
        ("served_empty_answers", "max_empty_answers"),
        ("teacher_forgetting", "max_teacher_forgetting"),
        ("student_forgetting", "max_student_forgetting"),
    ],
)
def test_a_relative_check_configured_as_null_is_disabled(name, setting):
    got = check(check_gate(GateConfig(**{setting: None}), {}), name)
    assert got.status == "off" and got.reason == f"disabled ({setting} is null)"


def test_the_headline_states_the_issue_figures_and_the_warnings():
    data = results(clean=(710, 300, 5_000_000, 2_000_000), empty=0.25, served_loss=2.2, teacher_bpb=2.3)
    data["gate"] = check_gate(GateConfig(), data).to_dict()
    head = headline(data)
    assert head["empty_answer_fraction"] == 0.25 and head["answer_loss_vs_teacher"] == pytest.approx(1.1)
    assert head["teacher_bits_per_byte_vs_base"] == pytest.approx(1.15) and head["answer_loss_model"] == "int8_dynamic"
    lines = headline_lines(head)
    assert lines[0].startswith("served model int8_dynamic: 25% of held-out prompts answered with an empty string")
    assert "answer loss 1.100x the teacher's" in lines[0] and "1.150x the base model's" in lines[1]
    assert lines[2] == "data retention: cleaning kept 42% of documents, 40% of bytes"
    assert lines[3] == "gate checks: 9 PASS, 0 FAIL, 3 n/a (not counted as passed), 0 off"
    assert lines[4].startswith("n/a student_exact_match: min_student_exact_match is 0")
    assert lines[-1].startswith("WARNING: cleaning kept 300 of 710 documents")
