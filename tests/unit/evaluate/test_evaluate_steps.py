"""evaluate_models' steps alone: which models it takes, the window it scores with and the generation summary."""

from __future__ import annotations

import logging

import pytest

from lmforge.config import EvaluateConfig, GenerationEvalConfig
from lmforge.errors import InputDataError
from lmforge.evaluate.evaluate import QASet, _generation_summary, _window, _with_base


def test_the_base_model_comes_first_among_the_pytorch_models():
    models = _with_base({"teacher": "t", "student": "s"}, {"onnx_fp32": "o"}, "b")
    assert list(models.items()) == [("base", "b"), ("teacher", "t"), ("student", "s")]
    assert _with_base({"student": "s"}, {}, "") == {"student": "s"}  # an unset base arrives as ""


@pytest.mark.parametrize(
    ("models", "onnx_models", "base", "message"),
    [
        ({"base": "b"}, {}, "b2", "evaluate: a base model given both as base= and in models"),
        ({"student": "s"}, {"student": "o"}, None, "model names given both as PyTorch and ONNX models: ['student']"),
        ({}, {}, None, "evaluate: no models given"),
    ],
    ids=["base-twice", "pytorch-and-onnx", "none"],
)
def test_a_model_given_twice_or_none_at_all_is_refused(models, onnx_models, base, message):
    with pytest.raises(InputDataError) as info:
        _with_base(models, onnx_models, base)
    assert str(info.value) == message


def test_the_window_is_clamped_to_the_smallest_model_and_says_so(caplog):
    cfg = EvaluateConfig(context=128, stride=96)
    with caplog.at_level(logging.WARNING, logger="lmforge.evaluate"):
        assert _window(cfg, {"a": {"n_positions": 256}, "b": {"n_positions": 64}, "c": {}}) == (64, 64)
    assert caplog.messages == ["context 128 exceeds a model's maximum positions; using 64 for all models"]
    caplog.clear()
    assert _window(cfg, {"a": {"n_positions": 256}}) == (128, 96)
    assert caplog.messages == []


QA = QASet(
    groups=[("Q1?", ["A1"]), ("Q2?", ["A2", "a2"])],
    uri="qa.jsonl",
    heldout_fraction=0.2,
    fraction_source="the LoRA stage's manifest",
    examples=[],
    chat_template="",
)


def test_the_generation_summary_says_why_nothing_was_generated():
    off = EvaluateConfig(generation=GenerationEvalConfig(enabled=False))
    assert _generation_summary(off, None, {}, {}) == {"status": "skipped", "reason": "disabled in config"}
    no_data = _generation_summary(EvaluateConfig(), None, {}, {})
    assert no_data == {"status": "skipped", "reason": "no Q&A data given or recorded in the teacher's manifest"}
    cfg = EvaluateConfig()
    nobody = _generation_summary(cfg, QA, {"onnx_fp32": {}}, {})
    assert (nobody["status"], nobody["reason"]) == (
        "skipped",
        f"none of {cfg.generation.models} was given as a PyTorch model",
    )
    assert nobody["bleu_signature"] is None and nobody["prompts"] == 2


def test_the_generation_summary_of_answered_prompts_carries_the_signature_and_samples():
    cfg = EvaluateConfig(generation=GenerationEvalConfig(samples=1))
    evaluated = {"student": {"generation": {"bleu_signature": "nrefs:2"}}}
    summary = _generation_summary(cfg, QA, evaluated, {"student": ["A1", "A2"]})
    assert summary["status"] == "evaluated" and summary["reason"] is None
    assert summary["bleu_signature"] == "nrefs:2"
    assert (summary["qa_uri"], summary["heldout_fraction"]) == ("qa.jsonl", 0.2)
    assert summary["samples"] == [{"prompt": "Q1?", "references": ["A1"], "answers": {"student": "A1"}}]
