"""The verdict in words: each rule of lmforge.evaluate.verdict, at and around its threshold."""

from __future__ import annotations

import pytest

from lmforge.evaluate.verdict import CHANCE_MARGIN_STDERR, F1_GOOD, F1_SOME, verdict_lines


def _results(f1: float, *, empty: int = 1, acc: float | None = None, stderr: float = 0.05, bpb: float = 1.3):
    generation = {"prompts": 24, "empty_predictions": empty}
    models = {
        "base": {"bits_per_byte": 1.3},
        "student": {"f1": f1, "generation": generation, "bits_per_byte": bpb},
    }
    harness = {}
    if acc is not None:
        harness = {
            "tasks": {"lmforge_qa_mc": {"chance": 0.25}, "lmforge_cloze": {"chance": None}},
            "scores": {"student": {"lmforge_qa_mc": {"acc": acc, "acc_stderr": stderr}, "lmforge_cloze": {"acc": 0.1}}},
        }
    return {"models": models, "harness": harness, "served_model": "int8_dynamic"}


def _student(results) -> str:
    return next(line for line in verdict_lines(results) if line.startswith("student"))


def test_poor_answers_are_called_not_useful_with_the_counts():
    line = _student(_results(0.11))
    assert line.startswith("student: answers 23 of 24 held-out questions, but F1 0.11 (0–1)")
    assert "not useful for answering questions yet" in line


@pytest.mark.parametrize(
    ("f1", "words"),
    [
        (F1_SOME - 0.01, "not useful for answering questions yet"),
        (F1_SOME, "answers some questions, check the samples"),
        (F1_GOOD - 0.01, "answers some questions, check the samples"),
        (F1_GOOD, "answers held-out questions well"),
    ],
)
def test_f1_thresholds_choose_the_words(f1, words):
    assert words in _student(_results(f1))


def test_multiple_choice_above_chance_only_past_the_stated_margin():
    at_margin = 0.25 + CHANCE_MARGIN_STDERR * 0.05
    assert "no better than chance" in _student(_results(0.1, acc=at_margin))
    line = _student(_results(0.1, acc=at_margin + 0.01))
    assert "picks the right answer in 36% of lmforge_qa_mc questions (chance 25%)" in line
    assert "no better than chance" not in line
    assert "lmforge_cloze" not in line  # no chance level stated: no multiple-choice phrase


def test_text_modelling_against_the_base():
    assert "as well as the base" in _student(_results(0.1, bpb=1.3 * 1.019))
    assert "10% worse than the base" in _student(_results(0.1, bpb=1.43))
    assert "10% better than the base" in _student(_results(0.1, bpb=1.17))
    base = next(line for line in verdict_lines(_results(0.1)) if line.startswith("base"))
    assert base == "base: 1.300 bits per byte on held-out corpus text."


def test_the_served_model_is_named_as_such_and_a_model_without_figures_is_left_out():
    results = _results(0.5)
    results["models"]["int8_dynamic"] = {"f1": 0.5, "generation": {"prompts": 24, "empty_predictions": 0}}
    results["models"]["teacher"] = {}
    lines = verdict_lines(results)
    assert [line.split(":")[0] for line in lines] == ["base", "student", "int8_dynamic (served)"]
