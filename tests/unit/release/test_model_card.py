"""The release's model card (huggingface_hub parses it; its numbers are the report's) and ``lmforge push``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from huggingface_hub.repocard_data import model_index_to_eval_results
from typer.testing import CliRunner

from lmforge.cli import application
from lmforge.release.model_card import CARD, write_cards
from tests.fakes.hf_hub_server import FakeHub

RESULTS = {
    "passed": True,
    "served_model": "int8_dynamic",
    "models": {
        "student": {
            "perplexity": 52.8,
            "bits_per_byte": 1.39,
            "exact_match": 0.0,
            "f1": 0.11,
            "bleu": 0.93,
            "rouge_l": 0.05,
        },
        "int8_dynamic": {"perplexity": 53.9, "bits_per_byte": 1.40},
        "onnx_fp32": {"perplexity": 52.8, "bits_per_byte": float("nan")},
    },
    "harness": {
        "status": "evaluated",
        "tasks": {"lmforge_qa_mc": {"chance": 0.25}, "lmforge_cloze": {}},
        "scores": {
            "student": {
                "lmforge_qa_mc": {"acc": 0.31, "acc_stderr": 0.06, "acc_norm": 0.29},
                "lmforge_cloze": {"perplexity": 812.5, "acc": 0.05},
            }
        },
    },
    "generation": {"qa_uri": "demo://chatterbot"},
    "data": {"clean": {"input": "demo://shakespeare"}},
    "verdict": [
        "student: answers 23 of 24 held-out questions, but F1 0.11 (0–1): not useful for answering questions yet."
    ],
}
EVALUATION = {
    "config": {"card": {"license": "apache-2.0", "language": ["en"], "tags": ["lmforge"], "base_model": None}},
    "inputs": {"shards": {"fingerprint": "f" * 64}},
}


@pytest.fixture
def release(tmp_path) -> Path:
    for name in ("student", "int8_dynamic", "onnx_fp32", "engine"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    write_cards(
        str(tmp_path),
        ["student", "int8_dynamic", "onnx_fp32", "engine"],
        model_name="shakespeare",
        version="v1",
        results=RESULTS,
        evaluation=EVALUATION,
    )
    return tmp_path


def _numbers(card: ModelCard) -> dict[tuple[str, str], float]:
    _, results = model_index_to_eval_results(card.data.to_dict()["model-index"])
    return {(r.dataset_type, r.metric_type): r.metric_value for r in results}


def test_the_card_parses_and_carries_the_runs_numbers(release):
    card = ModelCard.load(release / "student" / CARD)
    data = card.data.to_dict()
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert data["license"] == "apache-2.0" and data["datasets"] == ["demo://shakespeare", "demo://chatterbot"]
    student = RESULTS["models"]["student"]
    assert _numbers(card) == {
        ("lmforge-heldout-text", "perplexity"): student["perplexity"],
        ("lmforge-heldout-text", "bits_per_byte"): student["bits_per_byte"],
        ("lmforge-heldout-qa", "exact_match"): 0.0,
        ("lmforge-heldout-qa", "f1"): student["f1"],
        ("lmforge-heldout-qa", "bleu"): student["bleu"],
        ("lmforge-heldout-qa", "rouge"): student["rouge_l"],
        ("lmforge_qa_mc", "acc"): 0.31,
        ("lmforge_qa_mc", "acc_norm"): 0.29,
        ("lmforge_cloze", "perplexity"): 812.5,
        ("lmforge_cloze", "acc"): 0.05,
    }
    assert "f" * 64 in card.text and "not useful for answering questions yet" in card.text
    assert (release / CARD).read_text() == (release / "student" / CARD).read_text()
    # round trip: what ModelCard writes back is what it read
    again = tmp = release / "again.md"
    card.save(tmp)
    assert _numbers(ModelCard.load(again)) == _numbers(card)


def test_onnx_folders_get_their_own_card_and_the_engine_none(release):
    card = ModelCard.load(release / "int8_dynamic" / CARD)
    assert card.data.library_name == "onnx"
    assert _numbers(card) == {
        ("lmforge-heldout-text", "perplexity"): 53.9,
        ("lmforge-heldout-text", "bits_per_byte"): 1.40,
    }
    assert ("lmforge-heldout-text", "bits_per_byte") not in _numbers(ModelCard.load(release / "onnx_fp32" / CARD))
    assert not (release / "engine" / CARD).exists()


def test_push_uploads_the_folder_with_its_card_to_the_hub_stand_in(release, monkeypatch):
    with FakeHub("hf_test") as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_test")
        run = CliRunner().invoke(application(), ["push", str(release), "--to", "hf://acme/shakespeare-lm"])
        assert run.exit_code == 0, run.output
        assert hub.unexpected == []
        assert hub.repos == ["acme/shakespeare-lm"]
        assert hub.validated == [(release / "student" / CARD).read_text()]
        uploaded = hub.files["acme/shakespeare-lm"]
        assert uploaded[CARD] == (release / "student" / CARD).read_bytes() and "config.json" in uploaded
        assert "pushed student" in run.output


def test_push_without_a_token_or_with_a_bad_target_or_no_hub_says_why(release, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    app = application()
    run = CliRunner().invoke(app, ["push", str(release), "--to", "hf://acme/x"])
    assert run.exit_code == 2 and "needs a Hugging Face token" in run.output
    run = CliRunner().invoke(app, ["push", str(release), "--to", "acme/x", "--token", "t"])
    assert run.exit_code == 2 and "expected hf://<org>/<name>" in run.output
    with FakeHub("other") as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        run = CliRunner().invoke(app, ["push", str(release), "--to", "hf://acme/x", "--token", "wrong"])
        assert run.exit_code == 2 and "push to hf://acme/x" in run.output and "failed" in run.output
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: no network
    run = CliRunner().invoke(app, ["push", str(release), "--to", "hf://acme/x", "--token", "t"])
    assert run.exit_code == 2 and "failed" in run.output
    assert json.dumps(run.output)  # one readable error line, no traceback
    assert "Traceback" not in run.output
