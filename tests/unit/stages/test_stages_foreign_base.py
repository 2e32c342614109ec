"""Foreign base models through the stages: tokenize → pretrain (continued, and passed through) → LoRA → distill →
ONNX export, by calling the stage functions, for a GPT-2- and a Llama-shaped model written by plain ``save_pretrained``
with a tokenizer that is not lmforge's (another vocabulary size, other special tokens, no padding token)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmforge import storage
from lmforge.artifacts import read_manifest
from lmforge.config import (
    CleanConfig,
    DistillConfig,
    ExportConfig,
    LoraConfig,
    PretrainConfig,
    TokenizeConfig,
    TrainConfig,
)
from lmforge.data import clean, tokenize
from lmforge.export import export_onnx
from lmforge.onnx_runtime import OrtCausalLM
from lmforge.train import distill, finetune_lora, pretrain
from tests.support.foreign_base import gpt2_base, llama_base

pytestmark = pytest.mark.slow  # six stages per family, ONNX export included: about a minute each on 2 cores

TRAIN = dict(
    batch_size=4, seq_len=64, lr=3e-3, min_lr=3e-4, warmup_steps=1, precision="fp32", eval_interval=4,
    eval_batches=2, log_interval=2,
)  # fmt: skip


def _chain(root: Path, base: str, qa_jsonl: Path, shakespeare_docs: list[dict]) -> dict[str, Path]:
    with open(root / "corpus.jsonl", "w", encoding="utf-8") as fh:
        for doc in shakespeare_docs[:30]:
            fh.write(json.dumps({"text": doc["text"]}) + "\n")
    out = {name: root / name for name in ("cleaned", "tok", "shards", "pre", "passed", "adapter", "merged", "student")}
    clean.run(CleanConfig(min_chars=20, min_words=3), corpus_uri=str(root / "corpus.jsonl"), cleaned=out["cleaned"])
    tokenize.run(
        TokenizeConfig(val_fraction=0.2), cleaned=out["cleaned"], tokenizer=out["tok"], shards=out["shards"],
        base_model=base,
    )  # fmt: skip
    for name, steps in (("pre", 4), ("passed", 0)):
        cfg = PretrainConfig(train=TrainConfig(max_steps=steps, **TRAIN))
        pretrain.run(cfg, shards=out["shards"], tokenizer=out["tok"], model=out[name], base_model=base)
    finetune_lora.run(
        LoraConfig(train=TrainConfig(max_steps=4, **TRAIN)), base_model=out["pre"], qa_uri=str(qa_jsonl),
        adapter=out["adapter"], merged_model=out["merged"],
    )  # fmt: skip
    distill.run(
        DistillConfig(train=TrainConfig(max_steps=4, **TRAIN)), teacher=out["merged"], shards=out["shards"],
        student=out["student"],
    )  # fmt: skip
    out["onnx"] = root / "onnx"
    export_onnx.run(ExportConfig(), model=out["student"], onnx_model=out["onnx"])
    return out


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def chained(request, tmp_path_factory, shakespeare_docs, qa_jsonl) -> tuple[str, Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp(f"chain-{request.param}")
    make = gpt2_base if request.param == "gpt2" else llama_base
    base = make(root / "base", [d["text"] for d in shakespeare_docs])
    return request.param, base, _chain(root, str(base), qa_jsonl, shakespeare_docs)


def test_the_released_model_loads_with_transformers_and_generates(chained):
    _, _, out = chained
    model = AutoModelForCausalLM.from_pretrained(out["student"]).eval()
    tok = AutoTokenizer.from_pretrained(out["student"])
    enc = tok(["Question: What is your name?\nAnswer:"], return_tensors="pt")
    with torch.inference_mode():
        generated = model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert generated.shape[1] > enc["input_ids"].shape[1]
    assert isinstance(tok.decode(generated[0, enc["input_ids"].shape[1] :]), str)
    # the config's special ids are the tokenizer's (a plain GPT2Config says 50256 whatever the vocabulary)
    assert (model.config.eos_token_id, model.generation_config.eos_token_id) == (tok.eos_token_id,) * 2
    logits = OrtCausalLM(out["onnx"]).logits(enc["input_ids"].numpy())
    assert logits.shape[-1] == model.config.vocab_size


def test_every_output_carries_the_base_tokenizer(chained):
    _, base, out = chained
    original = AutoTokenizer.from_pretrained(base)
    for name in ("tok", "pre", "passed", "merged", "student"):
        tok = AutoTokenizer.from_pretrained(out[name])
        assert tok.get_vocab() == original.get_vocab(), name
        assert (tok.eos_token, tok.bos_token, tok.unk_token, tok.pad_token) == ("</s>", "<s>", "<unk>", "</s>"), name
    assert len(original) != 2048 and original.pad_token is None  # not what lmforge's own tokenize would make


def test_continued_pretraining_starts_from_the_base_and_zero_steps_pass_it_through(chained):
    family, base, out = chained
    original = load_file(base / "model.safetensors")
    passed, trained = load_file(out["passed"] / "model.safetensors"), load_file(out["pre"] / "model.safetensors")
    assert passed.keys() == original.keys()
    assert all(torch.equal(passed[k], original[k]) for k in original)
    assert any(not torch.equal(trained[k], original[k]) for k in original)
    assert json.loads((out["pre"] / "config.json").read_text())["model_type"] == family
    manifest = read_manifest(out["passed"], verify=True)
    assert manifest["passed_through"] is True and manifest["inputs"]["base_model"]["kind"] == "hf-model"
    assert manifest["metrics"]["steps"] == 0 and manifest["metrics"]["val_loss"] > 0
    assert read_manifest(out["pre"])["passed_through"] is False


def test_distillation_mixed_corpus_windows_with_the_fine_tuning_examples(chained):
    _, _, out = chained
    mixture = read_manifest(out["student"], verify=True)["mixture"]
    assert mixture["qa_fraction"] == 0.5 and mixture["example_rows"] == 4 * 2 and mixture["response_tokens"] > 0
    assert mixture["corpus_tokens"] == 4 * 2 * 64


@pytest.mark.s3
def test_a_base_on_s3_is_continued(tmp_path, s3_env, shakespeare_docs):
    uri = f"s3://{s3_env}/bases/gpt2"
    storage.copy_tree(str(gpt2_base(tmp_path / "base", [d["text"] for d in shakespeare_docs])), uri)
    with open(tmp_path / "corpus.jsonl", "w", encoding="utf-8") as fh:
        for doc in shakespeare_docs[:10]:
            fh.write(json.dumps({"text": doc["text"]}) + "\n")
    clean.run(CleanConfig(min_chars=20, min_words=3), corpus_uri=str(tmp_path / "corpus.jsonl"), cleaned=tmp_path / "c")
    tokenize.run(
        TokenizeConfig(val_fraction=0.2), cleaned=tmp_path / "c", tokenizer=tmp_path / "tok", shards=tmp_path / "s",
        base_model=uri,
    )  # fmt: skip
    cfg = PretrainConfig(train=TrainConfig(max_steps=2, **TRAIN))
    pretrain.run(cfg, shards=tmp_path / "s", tokenizer=tmp_path / "tok", model=tmp_path / "m", base_model=uri)
    assert read_manifest(tmp_path / "m")["inputs"]["base_model"]["uri"] == uri
