"""End to end: the compiled DAG runs under kfp.local and leaves every artifact a user expects."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmforge.artifacts import read_manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # ~2 min on an idle 2-core machine

SMALL = {
    "tokenize_overrides": {"vocab_size": 512},
    "pretrain_overrides": {
        "model.n_layer": 2,
        "model.n_embd": 64,
        "model.block_size": 64,
        "train.max_steps": 30,
        "train.warmup_steps": 5,
        "train.seq_len": 64,
        "train.batch_size": 8,
        "train.eval_interval": 15,
    },
    "finetune_lora_overrides": {"train.max_steps": 10, "train.warmup_steps": 2, "train.seq_len": 64},
    "distill_overrides": {"train.max_steps": 15, "train.warmup_steps": 2, "train.seq_len": 64, "train.batch_size": 8},
    "quantize_int8_overrides": {"calibration_sequences": 8, "calibration_seq_len": 32},
    "evaluate_overrides": {"context": 64, "max_eval_tokens": 2048, "latency_runs": 3},
}


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory, shakespeare_docs) -> Path:
    """40 scenes, then 3 exact copies (case and spacing changed) and 3 near copies (3 words changed) of some of
    them, which the dedup removes: the cleaned corpus is the 40 scenes' whatever the dedup settings."""
    scenes = shakespeare_docs[:40]
    copies = [{"id": f"exact-{i}", "text": "  " + scenes[i]["text"].upper().replace(" ", "  ")} for i in (3, 11, 25)]
    for i in (5, 17, 30):
        words = scenes[i]["text"].split(" ")
        words[10] = words[len(words) // 2] = words[-10] = "forsooth"
        copies.append({"id": f"near-{i}", "text": " ".join(words)})
    path = tmp_path_factory.mktemp("corpus") / "scenes.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for doc in scenes + copies:
            fh.write(json.dumps(doc) + "\n")
    return path


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, small_corpus):
    from lmforge_kfp.pipelines.local_run import run_pipeline_locally

    out = tmp_path_factory.mktemp("e2e")
    params = {
        "corpus_uri": str(small_corpus),
        "qa_uri": "demo://chatterbot",
        "release_root": str(out / "registry"),
        "release_version": "v-test",
        "clean_shards": 2,
        "dedup_band_groups": 3,
        "dedup_parts": 2,
        **{k: json.dumps(v) for k, v in SMALL.items()},
    }
    shown = io.StringIO()
    run = run_pipeline_locally(params, out / "runs", console="default", out=shown)
    (out / "console.txt").write_text(shown.getvalue(), encoding="utf-8")  # what `lmforge run` showed
    return run, out


ARTIFACTS = [
    ("dedup-union", "plan", "dedup-plan"),
    ("merge-shards", "cleaned", "cleaned-corpus"),
    ("tokenize", "tokenizer", "tokenizer"),
    ("tokenize", "shards", "token-shards"),
    ("pretrain", "model", "model"),
    ("finetune-lora", "adapter", None),
    ("finetune-lora", "merged_model", "model"),
    ("distill", "student", "model"),
    ("export-onnx", "onnx_model", "onnx-model"),
    ("quantize-int8", "int8_dynamic", "onnx-model"),
    ("quantize-int8", "int8_qdq", "onnx-model"),
    ("build-tensorrt", "engine", "tensorrt-engine"),
    ("evaluate", "evaluation", "evaluation"),
]


@pytest.mark.parametrize(("task", "name", "kind"), ARTIFACTS, ids=lambda x: str(x))
def test_every_stage_leaves_a_complete_artifact(local_run, task, name, kind):
    run, _ = local_run
    manifest = read_manifest(run.output(task, name), verify=True)
    if kind:
        assert manifest["kind"] == kind


def test_report_and_gate_and_release(local_run):
    run, out = local_run
    evaluation = run.output("evaluate", "evaluation")
    html = (evaluation / "report.html").read_text(encoding="utf-8")
    assert "<img" in html and "perplexity" in html.lower()
    results = json.loads((evaluation / "results.json").read_text())
    for model in ("teacher", "student", "onnx_fp32", "int8_dynamic"):
        assert np.isfinite(results["models"][model]["perplexity"]), model
    assert results["passed"] is True
    assert run.promoted
    release = out / "registry" / "models" / "scenes" / "v-test"
    manifest = read_manifest(release)
    assert manifest["version"] == "v-test"
    status = json.loads((run.output("build-tensorrt", "engine") / "status.json").read_text())
    assert status["status"] == "skipped" and status["reason"]


@pytest.mark.parametrize(
    ("task", "name"), [("pretrain", "model"), ("finetune-lora", "merged_model"), ("distill", "student")]
)
def test_models_load_with_transformers_and_generate(local_run, task, name):
    run, _ = local_run
    path = run.output(task, name)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("ROMEO: ", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids["input_ids"].shape[1]


def test_adapter_loads_with_peft(local_run):
    from peft import PeftModel

    run, _ = local_run
    base = AutoModelForCausalLM.from_pretrained(run.output("pretrain", "model"))
    tuned = PeftModel.from_pretrained(base, run.output("finetune-lora", "adapter"))
    assert any("lora_" in name for name, _ in tuned.named_parameters())


@pytest.mark.parametrize(
    ("task", "name"), [("export-onnx", "onnx_model"), ("quantize-int8", "int8_dynamic"), ("quantize-int8", "int8_qdq")]
)
def test_onnx_models_load_in_onnxruntime(local_run, task, name):
    run, _ = local_run
    session = ort.InferenceSession(str(run.output(task, name) / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.array([[1, 2, 3, 4]], dtype=np.int64)
    (logits,) = session.run(["logits"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    assert logits.shape[:2] == (1, 4) and np.isfinite(logits).all()


def test_a_candidate_worse_than_production_is_not_promoted(local_run, small_corpus):
    """Second run into the same registry with a barely trained student: the gate compares it with the
    release the first run promoted and stops it before promote."""
    from lmforge_kfp.pipelines.local_run import run_pipeline_locally

    _, out = local_run
    worse_student = {**SMALL["distill_overrides"], "init": "random", "train.max_steps": 2, "train.warmup_steps": 1}
    worse = {**SMALL, "distill_overrides": worse_student}
    params = {
        "corpus_uri": str(small_corpus),
        "qa_uri": "demo://chatterbot",
        "release_root": str(out / "registry"),
        "release_version": "v-worse",
        **{k: json.dumps(v) for k, v in worse.items()},
    }
    run = run_pipeline_locally(params, out / "runs")
    results = json.loads((run.output("evaluate", "evaluation") / "results.json").read_text())
    assert results["passed"] is False
    failed = [c["name"] for c in results["gate"]["checks"] if not c["passed"]]
    assert any("production" in name or "regression" in name or "bits_per_byte" in name for name in failed), failed
    assert not run.promoted
    assert not (out / "registry" / "models" / "scenes" / "v-worse").exists()
    latest = json.loads((out / "registry" / "models" / "scenes" / "latest.json").read_text())
    assert latest["version"] == "v-test"


def test_a_person_sees_a_line_per_stage_the_progress_and_what_was_made(local_run):
    from lmforge_kfp.pipelines.summary import summary_lines

    run, out = local_run
    lines = (out / "console.txt").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 150
    for stage in (
        "preflight",
        "clean-shard",
        "tokenize",
        "pretrain",
        "finetune-lora",
        "distill",
        "evaluate",
        "promote",
    ):
        assert any(line.startswith(f"✓ {stage} ") for line in lines), (stage, lines)
    assert any(line.strip().startswith("pretrain step ") for line in lines)
    assert not any("executor_input" in line or "Streamed logs" in line for line in lines)

    summary = summary_lines(run)
    release = out / "registry" / "models" / "scenes" / "v-test"
    assert "release: scenes v-test (published by this run)" in summary
    assert f"  {release}" in summary  # a path on its own line, never wrapped inside a sentence
    served = [line for line in summary if line.startswith("served model: ")]
    assert served and "MB" in served[0]
    assert "gate: passed" in "\n".join(summary)
    assert any(line.startswith("data: cleaning kept ") for line in summary)
    assert f"  {run.output('evaluate', 'evaluation') / 'report.html'}" in summary
    assert len(summary) + 1 < 20  # `lmforge run --quiet` prints these after its first line


def test_quiet_shows_nothing_and_verbose_everything_of_the_same_run(local_run, tmp_path):
    from lmforge_kfp.pipelines.console import RunConsole

    run, _ = local_run
    stream = (run.logs / "run.log").read_text(encoding="utf-8")
    for mode, expected in (("quiet", 0), ("verbose", stream.count("\n"))):
        shown = io.StringIO()
        console = RunConsole(tmp_path / mode, shown, mode)
        console.write(stream)
        console.close()
        assert shown.getvalue().count("\n") == expected, mode
    per_task = {p.stem for p in run.logs.glob("*.log")}
    assert {"run", "preflight", "pretrain", "evaluate", "promote"} <= per_task


def test_the_dags_partitioned_dedup_cleans_as_the_single_pod_clean_does(local_run, small_corpus, tmp_path):
    """2 shards, 3 band groups × 2 parts in the DAG against clean_shard + dedup_shards + merge in one process."""
    from lmforge.data import clean
    from lmforge.data.cleaned import read_cleaned
    from lmforge.stages import resolve_stage_config

    run, _ = local_run
    clean.run(resolve_stage_config("clean", "tiny-cpu"), corpus_uri=str(small_corpus), cleaned=tmp_path / "single")
    dag = run.output("merge-shards", "cleaned")
    assert list(read_cleaned(dag)) == list(read_cleaned(tmp_path / "single"))
    removed = json.loads((dag / "stats.json").read_text())["removed"]
    assert removed == json.loads((tmp_path / "single" / "stats.json").read_text())["removed"]
    assert (removed["exact_dedup"], removed["near_dedup"]) == (3, 3)
