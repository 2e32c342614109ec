"""The DAG under kfp.local starting from a base model a user brings: a Llama-shaped model (grouped-query attention)
written by plain ``save_pretrained`` with a tokenizer that is not lmforge's (another vocabulary size, other special
tokens, no padding token), continued for a few steps, through to promotion; the release carries the base's tokenizer
and generates. The DAG's own runs train GPT-2s (tests/integration/test_pipeline_local.py); a GPT-2-shaped foreign base,
and a base passed through untrained, go through the same stages in tests/unit/stages/test_stages_foreign_base.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmforge.artifacts import read_manifest
from tests.support.foreign_base import llama_base

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # one small DAG run: ~2 min on 2 busy cores

TRAIN = {"train.seq_len": 64, "train.batch_size": 4, "train.warmup_steps": 1, "train.eval_interval": 3}
OVERRIDES = {
    "finetune_lora_overrides": {**TRAIN, "train.max_steps": 3, "train.eval_batches": 2},
    "distill_overrides": {**TRAIN, "train.max_steps": 3, "train.eval_batches": 2},
    "quantize_int8_overrides": {"calibration_sequences": 4, "calibration_seq_len": 32, "gate_eval_tokens": 1024},
    # The models are a few steps from random: no answer is worth generating, so generation (and the gate's checks
    # that read answers) is off; the absolute thresholds are the demo's, for trained models. The forgetting checks
    # against the base model stay on, loosely: they need the base that pretrain passed on to evaluate.
    # The DAG scores 1024 held-out tokens (max_eval_tokens): the held-out minimum matches, so the checks count.
    "tokenize_overrides": {"min_val_tokens": 512, "min_val_documents": 1},
    "evaluate_overrides": {
        "context": 64,
        "max_eval_tokens": 1024,
        "latency_runs": 1,
        "generation.enabled": False,
        "harness.limit": 8,  # the packaged tasks on 8 documents each: what they score is not the subject here
        "gate.max_student_perplexity": 1.0e9,
        "gate.max_int8_perplexity_delta": 1.0,
        "gate.min_student_exact_match": None,
        "gate.max_empty_answers": None,
        "gate.max_answer_loss_increase": None,
        "gate.max_f1_drop": None,
        "gate.max_teacher_forgetting": 1.0,
        "gate.max_student_forgetting": 1.0,
    },
}
PRETRAIN_STEPS = 3  # continued pretraining


@pytest.fixture(scope="module")
def based_run(tmp_path_factory, shakespeare_docs, qa_jsonl):
    from lmforge_kfp.pipelines.local_run import run_pipeline_locally

    root = tmp_path_factory.mktemp("dag-llama")
    base = llama_base(root / "base", [d["text"] for d in shakespeare_docs])
    corpus = root / "plays.jsonl"
    with open(corpus, "w", encoding="utf-8") as fh:
        for doc in shakespeare_docs[:30]:
            fh.write(json.dumps({"text": doc["text"]}) + "\n")
    pretrain = {**TRAIN, "train.max_steps": PRETRAIN_STEPS, "train.eval_batches": 2}
    params = {
        "corpus_uri": str(corpus),
        "qa_uri": str(qa_jsonl),
        "base_model_uri": str(base),
        "release_root": str(root / "registry"),
        "release_version": "v1",
        **{k: json.dumps(v) for k, v in {**OVERRIDES, "pretrain_overrides": pretrain}.items()},
    }
    run = run_pipeline_locally(params, root / "runs", console="quiet")
    return base, run, root / "registry" / "models" / "plays" / "v1"


def test_a_run_from_a_foreign_base_is_promoted_and_its_release_generates(based_run):
    _, run, release = based_run
    assert run.promoted and read_manifest(release, verify=False)["version"] == "v1"
    model = AutoModelForCausalLM.from_pretrained(release / "student").eval()
    tok = AutoTokenizer.from_pretrained(release / "student")
    assert model.config.model_type == "llama"
    enc = tok(["ROMEO: What say you?"], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > enc["input_ids"].shape[1]
    assert isinstance(tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True), str)


def test_the_release_carries_the_base_models_tokenizer(based_run):
    base, run, release = based_run
    original = AutoTokenizer.from_pretrained(base)
    assert len(original) != 2048 and original.pad_token is None  # not what tokenize trains without a base
    for folder in (release / "student", release / "onnx_fp32", run.output("tokenize", "tokenizer")):
        tok = AutoTokenizer.from_pretrained(folder)
        assert tok.get_vocab() == original.get_vocab(), folder
        assert (tok.eos_token, tok.bos_token, tok.unk_token) == (original.eos_token, original.bos_token, "<unk>")


def test_pretrain_starts_from_the_base_and_evaluate_compares_with_what_it_passed_on(based_run):
    base, run, _ = based_run
    manifest = read_manifest(run.output("pretrain", "model"), verify=True)
    assert manifest["inputs"]["base_model"]["uri"] == str(base)
    assert manifest["passed_through"] is False
    results = json.loads((run.output("evaluate", "evaluation") / "results.json").read_text())
    assert Path(results["models"]["base"]["uri"]) == run.output("pretrain", "model")
    checks = {c["name"]: c for c in results["gate"]["checks"]}
    assert checks["teacher_forgetting"]["value"] is not None and checks["teacher_forgetting"]["passed"]
    assert results["headline"]["teacher_bits_per_byte_vs_base"] == pytest.approx(
        1 + checks["teacher_forgetting"]["value"]
    )
