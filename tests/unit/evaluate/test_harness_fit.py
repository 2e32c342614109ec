"""lm-evaluation-harness on a model whose context is shorter than some items' continuations: the real harness on a
real 32-token GPT-2 asserts ``len(continuation_enc) <= self.max_length`` (lm_eval/models/huggingface.py), so evaluate
leaves those items out, counts them, and a task with none left is n/a in the results, the report, the verdict and
the gate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.artifacts import write_manifest
from lmforge.config import GateConfig, ModelConfig
from lmforge.config.evaluate import HarnessConfig
from lmforge.evaluate.gate import NOT_APPLICABLE, check_gate
from lmforge.evaluate.harness import flat_metrics, run_harness, summary_lines
from lmforge.evaluate.report import harness_markdown, harness_rows
from lmforge.evaluate.verdict import choice_phrases
from lmforge.model.build import build_model, load_tokenizer, save_model_dir

pytest.importorskip("lm_eval")

CONTEXT = 32
MODEL = ModelConfig(arch="gpt2", n_layer=2, n_head=2, n_embd=32, block_size=CONTEXT)
WORD = "the"  # one token of the tiny tokenizer, with and without its leading space (checked below)
SHORT = [
    {"question": "Who art thou", "choices": ["a king", "a fool", "the moon", "my lord"], "label": 1},
    {"question": "What say you", "choices": ["nothing", "all", "farewell", "good night"], "label": 0},
    {"question": "Where is he", "choices": ["gone", "here", "in the court", "at sea"], "label": 2},
    {"question": "How now", "choices": ["well", "ill", "so so", "anon"], "label": 3},
]


def _words(n: int) -> str:
    return " ".join([WORD] * n)


def _long(question: str, tokens: int) -> dict:
    """An item whose first choice's continuation (" " + choice) is ``tokens`` tokens long."""
    return {"question": question, "choices": [_words(tokens), "a fool", "the moon", "my lord"], "label": 0}


FITS = [*SHORT, _long("Speak the speech", CONTEXT)]  # exactly the context: lm-eval scores it
TOO_LONG = [_long("Is this a dagger", CONTEXT + 1), _long("To be or not", CONTEXT + 40)]


def _task(folder: Path, name: str, items: list[dict]) -> str:
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items), encoding="utf-8")
    config = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": f"{name}.jsonl"}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "label",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0, "chance": 0.25},
    }
    path = folder / f"{name}.yaml"
    path.write_text(json.dumps(config), encoding="utf-8")  # JSON is YAML
    return str(path)


@pytest.fixture(scope="module")
def short_model(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    tok = load_tokenizer(tiny_tokenizer_dir)
    for n in (1, CONTEXT, CONTEXT + 1):
        assert len(tok(" " + _words(n))["input_ids"]) == n  # the items' continuations have the lengths they say
    model = build_model(MODEL, len(tok), eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, seed=0)
    out = save_model_dir(model, tok, tmp_path_factory.mktemp("short"))
    write_manifest(out, "model")
    return out


@pytest.fixture(scope="module")
def harness(short_model, tmp_path_factory) -> dict:
    """The real harness on a mixed task (2 of 7 items too long) and a task of too-long items only."""
    folder = tmp_path_factory.mktemp("tasks")
    tasks = [
        _task(folder, "mixed_mc", [FITS[0], TOO_LONG[0], *FITS[1:], TOO_LONG[1]]),
        _task(folder, "long_mc", TOO_LONG),
    ]
    cfg = HarnessConfig(tasks=tasks, batch_size=4, bootstrap_iters=0)
    return run_harness(cfg, {"student": short_model}, tmp_path_factory.mktemp("work"))


def test_items_longer_than_the_context_are_skipped_and_counted(harness):
    assert harness["errors"] == {}  # without the filter: {'student': 'AssertionError'} from lm-eval
    assert harness["status"] == "evaluated"
    assert harness["skipped"]["student"] == {
        "mixed_mc": {"skipped": 2, "documents": 7, "context": CONTEXT},
        "long_mc": {"skipped": 2, "documents": 2, "context": CONTEXT},
    }
    assert harness["tasks"]["mixed_mc"]["documents"] == 7
    assert "acc" in harness["scores"]["student"]["mixed_mc"]
    assert harness["scores"]["student"]["long_mc"] == {}
    assert (
        "harness student: mixed_mc: 2 of 7 items skipped: continuation longer than the model's context of 32 tokens"
        in (summary_lines(harness))
    )


def test_the_scores_are_those_of_the_fitting_items_alone(harness, short_model, tmp_path):
    cfg = HarnessConfig(tasks=[_task(tmp_path, "mixed_mc", FITS)], batch_size=4, bootstrap_iters=0)
    alone = run_harness(cfg, {"student": short_model}, tmp_path / "work")
    assert alone["skipped"] == {} and alone["errors"] == {}
    assert harness["scores"]["student"]["mixed_mc"] == alone["scores"]["student"]["mixed_mc"]


def test_a_task_with_every_item_skipped_is_n_a_in_the_report_the_verdict_and_the_gate(harness):
    teacher = {"mixed_mc": {"acc": 0.5}, "long_mc": {"acc": 0.5}}  # a longer-context teacher scored both
    shown = {**harness, "scores": {**harness["scores"], "teacher": teacher}}
    headers, rows = harness_rows(shown)
    student, teacher_row = (dict(zip(headers, row, strict=True)) for row in rows)
    assert student["mixed_mc acc"] == harness["scores"]["student"]["mixed_mc"]["acc"]
    assert (student["mixed_mc skipped"], student["long_mc acc"], student["long_mc skipped"]) == (
        "2 of 7",
        "n/a",
        "2 of 2",
    )
    assert (teacher_row["long_mc acc"], teacher_row["long_mc skipped"]) == (0.5, "0")
    assert "- student: long_mc: 2 of 2 items skipped: continuation longer than the model's context of 32 tokens" in (
        harness_markdown(shown)
    )
    phrases = choice_phrases("student", harness)
    assert "long_mc n/a (2 of 2 items skipped: continuation longer than the model's context of 32 tokens)" in phrases

    results = {"models": flat_metrics(harness), "harness": harness, "production": {"status": "none"}}
    cfg = GateConfig(harness={"harness.long_mc.acc": {"min": 0.3}, "harness.mixed_mc.acc": {"min": 0.0}})
    checks = {c.name: c for c in check_gate(cfg, results).checks if c.name.startswith("harness.")}
    assert checks["harness.long_mc.acc"].status == NOT_APPLICABLE
    assert "2 of 2 items skipped" in checks["harness.long_mc.acc"].reason
    assert checks["harness.mixed_mc.acc"].passed  # the task with items left is checked
