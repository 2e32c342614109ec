"""lm-evaluation-harness inside evaluate: the packaged tasks, scores equal to lm_eval's own command line, a model
trained to prefer the right answers beats chance while a random one is at chance, and harness gate checks."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge.artifacts import write_manifest
from lmforge.config import GateConfig, ModelConfig
from lmforge.config.evaluate import HarnessConfig
from lmforge.evaluate.gate import check_gate
from lmforge.evaluate.harness import flat_metrics, prepare_tasks, run_harness
from lmforge.evaluate.harness_data import TASKS_DIR, build_task_data, qa_multiple_choice
from lmforge.model.build import build_model, load_tokenizer, save_model_dir

pytest.importorskip("lm_eval")

MODEL = ModelConfig(arch="gpt2", n_layer=2, n_head=2, n_embd=32, block_size=128)  # every choice fits 128 tokens


def _model(tokenizer_dir: Path, out: Path, seed: int = 0) -> tuple[torch.nn.Module, object]:
    tok = load_tokenizer(tokenizer_dir)
    model = build_model(MODEL, len(tok), eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, seed=seed)
    return model, tok


def _save(model, tok, out: Path) -> Path:
    save_model_dir(model, tok, out)
    write_manifest(out, "model")
    return out


@pytest.fixture(scope="module")
def random_model(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    model, tok = _model(tiny_tokenizer_dir, tmp_path_factory.mktemp("random"))
    return _save(model, tok, tmp_path_factory.mktemp("random"))


def test_the_shipped_task_data_is_what_the_builder_makes(tmp_path):
    for path in build_task_data(tmp_path):
        assert path.read_bytes() == (TASKS_DIR / path.name).read_bytes(), path.name
    items = list(qa_multiple_choice())
    assert len(items) >= 40 and all(len(i["choices"]) == 4 and i["choices"][i["label"]] for i in items)


def test_task_yaml_data_files_resolve_against_the_yaml_and_from_s3(tmp_path, s3_env):
    from lmforge import storage

    data = (TASKS_DIR / "lmforge_qa_mc.jsonl").read_bytes()
    yaml_text = (TASKS_DIR / "lmforge_qa_mc.yaml").read_text().replace("task: lmforge_qa_mc", "task: my_mc")
    storage.write_bytes(f"s3://{s3_env}/tasks/my_mc.yaml", yaml_text.encode())
    storage.write_bytes(f"s3://{s3_env}/tasks/lmforge_qa_mc.jsonl", data)
    names, registry = prepare_tasks([f"s3://{s3_env}/tasks/my_mc.yaml", "lmforge_cloze"], tmp_path / "inc")
    assert names == ["my_mc", "lmforge_cloze"] and not registry
    written = (tmp_path / "inc" / "my_mc.yaml").read_text()
    local = Path(written.split("test: ")[1].split("\n")[0])
    assert local.is_absolute() and local.read_bytes() == data

    storage.delete(f"s3://{s3_env}/tasks/lmforge_qa_mc.jsonl")
    from lmforge.errors import LmforgeError

    with pytest.raises(LmforgeError, match="lmforge_qa_mc.jsonl"):
        prepare_tasks([f"s3://{s3_env}/tasks/my_mc.yaml"], tmp_path / "inc2")


@pytest.mark.slow
def test_scores_equal_lm_eval_command_line_on_the_same_model_and_yaml(random_model, tmp_path):
    cfg = HarnessConfig(limit=12, batch_size=8, bootstrap_iters=100_000)  # the command line's bootstrap
    ours = run_harness(cfg, {"student": random_model}, tmp_path / "work")
    include = tmp_path / "work" / "harness-tasks"
    out = tmp_path / "cli"
    cmd = [
        *(sys.executable, "-m", "lm_eval", "--model", "hf"),
        *("--model_args", f"pretrained={random_model},dtype=float32", "--include_path", str(include)),
        *("--tasks", "lmforge_qa_mc,lmforge_cloze", "--limit", "12", "--batch_size", "8", "--device", "cpu"),
        *("--output_path", str(out)),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    cli = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    compared = 0
    for task, scores in ours["scores"]["student"].items():
        for metric, value in scores.items():
            theirs = cli[task][f"{metric.replace('_stderr', '')}{'_stderr' if metric.endswith('_stderr') else ''},none"]
            assert math.isclose(value, theirs, rel_tol=1e-6, abs_tol=1e-6), (task, metric, value, theirs)
            compared += 1
    assert compared >= 8


def _train_on_right_answers(model, tok, steps: int = 150) -> None:
    """Fine-tune on "Question: q\\nAnswer: <right answer>" of the packaged multiple-choice items."""
    texts = [
        f"Question: {i['question']}\nAnswer: {i['choices'][i['label']]}{tok.eos_token}" for i in qa_multiple_choice()
    ]
    batch = tok(texts, padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    torch.manual_seed(0)
    for _ in range(steps):
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@pytest.mark.slow
def test_a_model_trained_on_the_right_answers_beats_chance_and_a_random_one_is_at_chance(
    random_model, tiny_tokenizer_dir, tmp_path
):
    model, tok = _model(tiny_tokenizer_dir, tmp_path)
    _train_on_right_answers(model, tok)
    trained = _save(model, tok, tmp_path / "trained")
    cfg = HarnessConfig(tasks=["lmforge_qa_mc"])
    result = run_harness(cfg, {"student": trained, "base": random_model}, tmp_path / "work")
    trained_acc = result["scores"]["student"]["lmforge_qa_mc"]["acc"]
    random_acc = result["scores"]["base"]["lmforge_qa_mc"]["acc"]
    n = result["tasks"]["lmforge_qa_mc"]["documents"]
    tolerance = 3 * math.sqrt(0.25 * 0.75 / n)  # three binomial standard errors of chance (1 in 4) over n items
    assert abs(random_acc - 0.25) <= tolerance, (random_acc, tolerance)
    assert trained_acc > 0.25 + tolerance, (trained_acc, tolerance)


def _gate_results(student_acc: float, teacher_acc: float = 0.5, production: float | None = None) -> dict:
    harness = {
        "tasks": {"lmforge_qa_mc": {"higher_is_better": {"acc": True}}},
        "scores": {
            "student": {"lmforge_qa_mc": {"acc": student_acc}},
            "teacher": {"lmforge_qa_mc": {"acc": teacher_acc}},
        },
    }
    models = {name: dict(figures) for name, figures in flat_metrics(harness).items()}
    found = {"status": "found", "version": "v1", "metrics": {"student_harness.lmforge_qa_mc.acc": production}}
    return {"models": models, "harness": harness, "production": found if production else {"status": "none"}}


def _harness_checks(cfg: GateConfig, results: dict) -> dict:
    return {c.name: c for c in check_gate(cfg, results).checks if c.name.startswith("harness.")}


def test_a_harness_floor_stops_a_promotion():
    cfg = GateConfig(harness={"harness.lmforge_qa_mc.acc": {"min": 0.4}})
    failing = check_gate(cfg, _gate_results(0.3))
    assert not failing.passed
    check = next(c for c in failing.checks if c.name == "harness.lmforge_qa_mc.acc")
    assert not check.passed and check.value == 0.3 and "too low" in check.reason
    assert _harness_checks(cfg, _gate_results(0.45))["harness.lmforge_qa_mc.acc"].passed


def test_harness_checks_against_the_teacher_and_production():
    cfg = GateConfig(
        harness={"harness.lmforge_qa_mc.acc": {"max_drop_vs_teacher": 0.2, "max_drop_vs_production": 0.05}}
    )
    checks = _harness_checks(cfg, _gate_results(0.38, teacher_acc=0.5, production=0.45))
    assert checks["harness.lmforge_qa_mc.acc_vs_teacher"].value == pytest.approx(0.24)
    assert not checks["harness.lmforge_qa_mc.acc_vs_teacher"].passed
    assert checks["harness.lmforge_qa_mc.acc_vs_production"].value == pytest.approx(0.07)
    assert not checks["harness.lmforge_qa_mc.acc_vs_production"].passed
    checks = _harness_checks(cfg, _gate_results(0.45, teacher_acc=0.5, production=0.45))
    assert all(c.passed for c in checks.values())


def test_a_lower_is_better_harness_metric_is_checked_as_a_ceiling():
    harness = {
        "tasks": {"lmforge_cloze": {"higher_is_better": {"perplexity": False}}},
        "scores": {"student": {"lmforge_cloze": {"perplexity": 900.0}}},
    }
    results = {"models": flat_metrics(harness), "harness": harness, "production": {"status": "none"}}
    cfg = GateConfig(harness={"harness.lmforge_cloze.perplexity": {"min": 500.0}})
    check = _harness_checks(cfg, results)["harness.lmforge_cloze.perplexity"]
    assert not check.passed and "too high" in check.reason


def test_a_missing_harness_metric_fails_its_check():
    cfg = GateConfig(harness={"harness.hellaswag.acc": {"min": 0.3}})
    check = _harness_checks(cfg, _gate_results(0.5))["harness.hellaswag.acc"]
    assert not check.passed and "missing" in check.reason
