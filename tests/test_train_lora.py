"""The ``finetune_lora`` stage: answer-only labels, PEFT adapter equal to the merged model."""

from __future__ import annotations

import shutil
from pathlib import Path

import peft
import pytest
import torch

from lmforge.artifacts import read_manifest, write_manifest
from lmforge.config import LoraConfig, ModelConfig, TrainConfig
from lmforge.data.qa import QAPair
from lmforge.errors import ConfigError
from lmforge.model.build import build_model, load_causal_lm, load_tokenizer
from lmforge.train import lora

CFG = LoraConfig(
    r=4,
    alpha=8,
    dropout=0.0,
    heldout_fraction=0.1,
    train=TrainConfig(
        max_steps=12, batch_size=8, seq_len=48, lr=5e-3, min_lr=5e-4, warmup_steps=2, precision="fp32",
        eval_interval=6, eval_batches=2, log_interval=4,
    ),
)  # fmt: skip


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tiny_model_dir) -> Path:
    out = tmp_path_factory.mktemp("lora-base") / "model"
    shutil.copytree(tiny_model_dir, out)
    write_manifest(out, "model")
    return out


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, base_dir, qa_jsonl):
    root = tmp_path_factory.mktemp("lora")
    result = lora.run(CFG, base_dir, qa_jsonl, root / "adapter", root / "merged")
    return result, root / "adapter", root / "merged"


def test_prompt_and_padding_positions_are_masked_from_the_loss(tiny_tokenizer_dir):
    tok = load_tokenizer(tiny_tokenizer_dir)
    pair = QAPair("Who is Romeo?", "A lover.")
    prompt_ids = tok("Question: Who is Romeo?\nAnswer:")["input_ids"]
    response_ids = tok(" A lover.<|endoftext|>")["input_ids"]
    assert response_ids[-1] == tok.eos_token_id

    ids, labels = lora.encode_pair(tok, pair, max_len=100)
    assert ids == prompt_ids + response_ids
    assert labels == [-100] * len(prompt_ids) + response_ids

    short_ids, short_labels = lora.encode_pair(tok, pair, max_len=len(prompt_ids) + 1)
    assert short_ids == prompt_ids + response_ids[:1] and short_labels[-1] == response_ids[0]

    batch = lora.collate([(ids, labels), (ids[:3], labels[:3])], pad_id=tok.pad_token_id)
    assert batch["input_ids"].shape == (2, len(ids) - 1)
    assert batch["input_ids"][0].tolist() == ids[:-1] and batch["targets"][0].tolist() == labels[1:]
    assert batch["input_ids"][1, 3:].eq(tok.pad_token_id).all()
    assert batch["targets"][1].eq(-100).all()  # three prompt tokens then padding: nothing scored


def test_adapter_on_base_matches_merged_model(tuned, base_dir):
    _, adapter_dir, merged_dir = tuned
    base = load_causal_lm(base_dir)
    adapted = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    merged = load_causal_lm(merged_dir)
    ids = torch.randint(2, merged.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = adapted(input_ids=ids).logits
        actual = merged(input_ids=ids).logits
    assert torch.allclose(actual, expected, atol=1e-4)
    # the adapter changed the model: the merged weights differ from the base
    assert not torch.allclose(actual, load_causal_lm(base_dir)(input_ids=ids).logits, atol=1e-4)


def test_finetuning_lowers_heldout_answer_loss_and_writes_manifests(tuned):
    result, adapter_dir, merged_dir = tuned
    assert result.metrics["tuned_heldout_loss"] < result.metrics["base_heldout_loss"]
    assert 0 < result.metrics["trainable_fraction"] < 0.5
    assert (adapter_dir / "adapter_config.json").is_file() and (adapter_dir / "tokenizer.json").is_file()
    assert read_manifest(adapter_dir, verify=True)["kind"] == "adapter"
    merged = read_manifest(merged_dir, verify=True)
    assert merged["kind"] == "model" and set(merged["inputs"]) == {"base_model", "qa"}
    assert merged["config"]["resolved_target_modules"] == ["c_attn", "c_proj", "c_fc"]


def test_unknown_target_module_is_named_in_the_error(tmp_path, base_dir, qa_jsonl):
    cfg = CFG.model_copy(update={"target_modules": ["c_attn", "q_proj"]})
    with pytest.raises(ConfigError, match=r"'q_proj' matches no module of the gpt2 model") as info:
        lora.run(cfg, base_dir, qa_jsonl, tmp_path / "adapter", tmp_path / "merged")
    assert "\n" not in str(info.value)


def test_default_llama_targets_exist_in_a_llama_model():
    shape = ModelConfig(arch="llama", n_layer=1, n_head=2, n_embd=16, block_size=32)
    model = build_model(shape, 64, eos_id=0, pad_id=1, seed=0)
    targets = lora.target_modules(model, None)
    assert targets == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=targets))
    assert sum(p.numel() for p in adapted.parameters() if p.requires_grad) > 0


def test_seq_len_that_cuts_off_every_answer_is_refused(tmp_path, base_dir, qa_jsonl):
    cfg = CFG.model_copy(update={"train": CFG.train.model_copy(update={"seq_len": 3})})
    with pytest.raises(ConfigError, match=r"seq_len \(3\) cuts off every held-out answer"):
        lora.run(cfg, base_dir, qa_jsonl, tmp_path / "adapter", tmp_path / "merged")
