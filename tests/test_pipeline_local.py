"""End to end: the compiled DAG runs under kfp.local and leaves every artifact a user expects."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import torch
import yaml
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
    "serve_overrides": {"apply": True},  # asked to apply, yet kfp.local has no cluster: skipped, and says why
}


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory, shakespeare_docs) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "scenes.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for doc in shakespeare_docs[:40]:
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
        **{k: json.dumps(v) for k, v in SMALL.items()},
    }
    with pytest.MonkeyPatch.context() as env:  # no cluster for serve's apply, whatever kubeconfig this machine has
        env.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        env.setenv("KUBECONFIG", str(out / "no-kubeconfig"))
        return run_pipeline_locally(params, out / "runs"), out


ARTIFACTS = [
    ("dedup-shards", "plan", None),
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
    ("serve", "serving", "serving"),
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


def test_serve_writes_the_inference_service_of_the_release_and_skips_the_apply_without_a_cluster(local_run):
    from lmforge_kfp.commands import _serve_hint
    from lmforge_kfp.components.images import service_image

    run, out = local_run
    release = out / "registry" / "models" / "scenes" / "v-test"
    serving = run.output("serve", "serving")
    served = "int8_dynamic" if "int8_dynamic" in read_manifest(release)["artifacts"] else "onnx_fp32"
    isvc = yaml.safe_load((serving / "inferenceservice.yaml").read_text())
    assert (isvc["kind"], isvc["metadata"]["name"]) == ("InferenceService", "scenes")
    assert isvc["spec"]["predictor"]["model"]["storageUri"] == str(release / served)
    runtime = yaml.safe_load((serving / "servingruntime.yaml").read_text())
    assert runtime["spec"]["containers"][0]["image"] == service_image("serve")  # the image the pipeline builds
    status = json.loads((serving / "status.json").read_text())
    assert (status["status"], status["reason"], status["written"]) == ("skipped", "no cluster", [])
    assert _serve_hint(run) == f"serve it: lmforge serve {release} --port 8080"  # the demo summary's last line


def test_the_serve_command_of_the_summary_serves_the_new_release(local_run, tmp_path):
    from serve_helpers import serving

    run, _ = local_run
    command = json.loads((run.output("serve", "serving") / "status.json").read_text())["local_command"].split()
    assert command[:2] == ["lmforge", "serve"] and command[3:] == ["--port", "8080"]
    limits = {"max_tokens_limit": 4, "default_max_tokens": 4}
    with serving(Path(command[2]), tmp_path / "serve.log", limits, cli=True) as server:  # on a free port, not 8080
        body = {"model": "scenes", "prompt": "ROMEO:", "max_tokens": 4}
        resp = httpx.post(f"{server.url}/openai/v1/completions", json=body, timeout=60)
        too_many = httpx.post(f"{server.url}/openai/v1/completions", json={**body, "max_tokens": 5}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] <= 4 and isinstance(resp.json()["choices"][0]["text"], str)
    assert too_many.status_code == 400 and "max_tokens" in too_many.text  # --set serve.max_tokens_limit=4 applied


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
    assert not (run.run_dir / "serve").exists()  # serve sits under the same gate
    assert not (out / "registry" / "models" / "scenes" / "v-worse").exists()
    latest = json.loads((out / "registry" / "models" / "scenes" / "latest.json").read_text())
    assert latest["version"] == "v-test"
