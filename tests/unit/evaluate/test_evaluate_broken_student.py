"""The evaluate stage stops a useless student (distilled for 1 step) by comparing it with its teacher, shows the base,
teacher and student side by side, and warns when cleaning kept a small part of the corpus."""

from __future__ import annotations

import json

import pytest

from lmforge.config import (
    CleanConfig,
    DistillConfig,
    EvaluateConfig,
    GateConfig,
    GenerationEvalConfig,
    LoraConfig,
    TrainConfig,
)
from lmforge.config.evaluate import HarnessConfig
from lmforge.data import clean
from lmforge.evaluate import evaluate
from lmforge.train import distill, finetune_lora

pytestmark = pytest.mark.slow  # a LoRA teacher worth comparing with: about 40 s on 2 cores

TRAIN = dict(
    batch_size=16, seq_len=48, lr=1e-2, min_lr=1e-3, precision="fp32", eval_interval=40, eval_batches=2,
    log_interval=20,
)  # fmt: skip
# The demo's target: the served model's held-out answer loss within 10 % of the teacher's.
CFG = EvaluateConfig(
    context=64,
    max_eval_tokens=600,
    latency_runs=1,
    generation=GenerationEvalConfig(max_prompts=8, max_new_tokens=6, batch_size=8, samples=2),
    harness=HarnessConfig(enabled=False),  # the served model's answers are the subject here
    gate=GateConfig(max_answer_loss_increase=0.1),
)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, tiny_model_dir, tiny_shards_dir, qa_jsonl, shakespeare_docs):
    root = tmp_path_factory.mktemp("broken")
    finetune_lora.run(
        LoraConfig(modules_to_save=["wte"], train=TrainConfig(max_steps=80, warmup_steps=2, **TRAIN)),
        base_model=tiny_model_dir, qa_uri=str(qa_jsonl), adapter=root / "adapter", merged_model=root / "teacher",
    )  # fmt: skip
    broken = DistillConfig(init="random", train=TrainConfig(max_steps=1, warmup_steps=0, **TRAIN))
    distill.run(broken, teacher=root / "teacher", shards=tiny_shards_dir, student=root / "student")
    # a corpus where cleaning keeps 10 of 100 documents: 90 are too short to pass the word-count rule
    with open(root / "corpus.jsonl", "w", encoding="utf-8") as fh:
        for i in range(100):
            text = shakespeare_docs[i]["text"] if i < 10 else f"buy {i}"
            fh.write(json.dumps({"text": text}) + "\n")
    clean.run(CleanConfig(min_chars=20, min_words=3), corpus_uri=str(root / "corpus.jsonl"), cleaned=root / "cleaned")
    result = evaluate.run(
        CFG, shards=tiny_shards_dir, evaluation=root / "evaluation", teacher=root / "teacher",
        student=root / "student", cleaned=root / "cleaned", base=tiny_model_dir,
    )  # fmt: skip
    return root / "evaluation", result


def test_a_student_distilled_for_one_step_is_stopped_by_the_comparison_with_its_teacher(evaluated):
    _, result = evaluated
    failed = {c["name"]: c["reason"] for c in result.summary["checks"] if not c["passed"]}
    assert result.summary["passed"] is False
    assert "answer_loss_vs_teacher" in failed
    assert failed["answer_loss_vs_teacher"].startswith("student held-out answer loss increase vs teacher")
    assert result.metrics["student_answer_loss"] > 1.1 * result.metrics["teacher_answer_loss"]


def test_the_report_shows_base_teacher_and_student_on_both_tasks(evaluated):
    out, result = evaluated
    results = json.loads((out / "results.json").read_text())
    for name in ("base", "teacher", "student"):
        entry = results["models"][name]
        assert entry["bits_per_byte"] > 0 and entry["answer_loss"] > 0 and 0 <= entry["empty_answer_fraction"] <= 1
    assert results["models"]["teacher"]["answer_loss"] < results["models"]["base"]["answer_loss"]  # LoRA helped
    assert "base (pretrained)" in result.html and "answer loss" in result.html
    assert results["headline"]["teacher_bits_per_byte_vs_base"] > 0


def test_a_corpus_where_cleaning_keeps_under_20_percent_fails_the_retention_check_and_warns(evaluated):
    out, result = evaluated
    (warning,) = result.summary["warnings"]
    assert warning.startswith("cleaning kept 10 of 100 documents (10.0%)") and "below the 50% warning level" in warning
    summary = result.html.split("<h2>Summary</h2>", 1)[1].split("<h2>", 1)[0]
    assert "WARNING: cleaning kept 10 of 100 documents" in summary
    assert "WARNING: cleaning kept 10 of 100 documents" in (out / "report.md").read_text()
    retention = {c["name"]: c for c in result.summary["checks"]}["data_retention"]
    assert retention["status"] == "fail" and retention["value"] == pytest.approx(0.1, abs=0.01)
    assert "10.0% < 25.0%: too low" in retention["reason"]


def test_the_summary_carries_the_headline_for_the_cli(evaluated):
    _, result = evaluated
    head = result.summary["headline"]
    assert head["served_model"] == "student" and head["answer_loss_model"] == "student"
    assert head["retention_documents"] == pytest.approx(0.1)
    assert head["warnings"] == result.summary["warnings"]


def test_lmforge_runs_last_lines_state_the_figures_and_the_retention_warning(evaluated, tmp_path, capsys):
    """`lmforge run` ends with the headline of this evaluation: its run directory holds just evaluate's output here."""
    import shutil

    from lmforge_kfp.commands import _print_summary
    from lmforge_kfp.pipelines.local_run import LocalRun

    out, _ = evaluated
    run = LocalRun(run_dir=tmp_path / "run-1" / "pipeline", seconds=1.0, logs=tmp_path / "run-1" / "logs")
    shutil.copytree(out, run.output("evaluate", "evaluation"))
    _print_summary(run, quiet=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "serve: nothing released, nothing to serve"
    warnings = [line for line in lines if line.startswith("WARNING: ")]
    assert warnings[-1].startswith("WARNING: cleaning kept 10 of 100 documents (10.0%)")
    assert lines.index(warnings[-1]) < next(i for i, line in enumerate(lines) if line.startswith("verdict: student"))
    at = next(i for i, line in enumerate(lines) if line.startswith("data retention: "))
    assert lines[at] == "data retention: cleaning kept 10% of documents, " + lines[at].rsplit(", ", 1)[1]
    assert lines[at - 2].startswith("served model student: ") and "answer loss " in lines[at - 2]
    assert lines[at - 1].startswith("teacher bits/byte on held-out corpus text: ") and "n/a" not in lines[at - 1]
    assert lines[at + 1].startswith("gate checks: ") and " FAIL, " in lines[at + 1]
    # 600 held-out tokens scored (max_eval_tokens) and 8 prompts: both below their minimums
    assert any(line.startswith("WARNING: held-out text: low confidence: 600 tokens / ") for line in lines)
    assert "WARNING: held-out Q&A: low confidence: 8 prompts (minimum 20)" in lines
