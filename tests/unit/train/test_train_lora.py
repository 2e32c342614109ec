"""The ``finetune_lora`` stage: answer-only labels, PEFT adapter equal to the merged model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import peft
import pytest
import torch

from lmforge.artifacts import read_manifest, write_manifest
from lmforge.config import LoraConfig, ModelConfig
from lmforge.errors import ConfigError, InputDataError
from lmforge.model.build import build_model, load_causal_lm
from lmforge.model.lora import DEFAULT_TARGETS
from lmforge.train import finetune_lora
from tests.support.tiny_training import tiny_train

CFG = LoraConfig(
    r=4,
    alpha=8,
    dropout=0.0,
    heldout_fraction=0.1,
    train=tiny_train(
        max_steps=12, batch_size=8, seq_len=48, lr=5e-3, min_lr=5e-4, warmup_steps=2, eval_interval=6, eval_batches=2,
        log_interval=4,
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
    result = finetune_lora.run(
        CFG, base_model=base_dir, qa_uri=qa_jsonl, adapter=root / "adapter", merged_model=root / "merged"
    )
    return result, root / "adapter", root / "merged"


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


def test_finetuning_lowers_heldout_answer_loss_and_writes_manifests(tuned, base_dir):
    result, adapter_dir, merged_dir = tuned
    assert result.metrics["tuned_heldout_loss"] < result.metrics["base_heldout_loss"]
    assert 0 < result.metrics["trainable_fraction"] < 0.5
    assert (adapter_dir / "adapter_config.json").is_file() and (adapter_dir / "tokenizer.json").is_file()
    assert read_manifest(adapter_dir, verify=True)["kind"] == "adapter"
    merged = read_manifest(merged_dir, verify=True)
    assert merged["kind"] == "model" and set(merged["inputs"]) == {"base_model", "qa"}
    assert merged["config"]["resolved_target_modules"] == ["c_attn", "c_proj", "c_fc"]
    assert merged["inputs"]["base_model"]["uri"] == str(base_dir)
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base_dir)


def test_unknown_target_module_is_named_in_the_error(tmp_path, base_dir, qa_jsonl):
    cfg = CFG.model_copy(update={"target_modules": ["c_attn", "q_proj"]})
    with pytest.raises(ConfigError, match=r"'q_proj' matches no module of the gpt2 model") as info:
        finetune_lora.run(
            cfg, base_model=base_dir, qa_uri=qa_jsonl, adapter=tmp_path / "adapter", merged_model=tmp_path / "merged"
        )
    assert "\n" not in str(info.value)


def test_seq_len_that_cuts_off_every_answer_is_refused(tmp_path, base_dir, qa_jsonl):
    cfg = CFG.model_copy(update={"train": CFG.train.model_copy(update={"seq_len": 3})})
    with pytest.raises(ConfigError, match=r"seq_len \(3\) cuts off every held-out answer"):
        finetune_lora.run(
            cfg, base_model=base_dir, qa_uri=qa_jsonl, adapter=tmp_path / "adapter", merged_model=tmp_path / "merged"
        )


def _logits(model: torch.nn.Module, vocab: int) -> torch.Tensor:
    ids = torch.randint(2, vocab, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_seeds_preset_is_rank_64_alpha_16_dropout_01_scaling_quarter():
    seeds = LoraConfig(preset="seeds")
    assert (seeds.r, seeds.alpha, seeds.dropout, seeds.scaling) == (64, 16, 0.1, 0.25)
    assert LoraConfig(preset="seeds", use_rslora=True).scaling == pytest.approx(2.0)  # alpha / sqrt(r)
    assert LoraConfig(preset="seeds", r=32).r == 32  # explicit fields win over the preset
    assert LoraConfig.model_validate(seeds.model_dump(exclude={"train"})) == seeds


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"r": 0}, "r"),
        ({"dropout": 1.0}, "dropout"),
        ({"bias": "some"}, "bias"),
        ({"target_modules": []}, "target_modules"),
        ({"target_modules": ["c_attn", "c_attn"]}, "lists a module twice"),
        ({"target_modules": ["c_attn"], "modules_to_save": ["c_attn"]}, "both LoRA targets and in modules_to_save"),
        ({"layers_to_transform": [-1]}, "block indices"),
        ({"preset": "huge"}, "preset"),
    ],
)
def test_invalid_lora_fields_are_rejected(fields, message):
    from lmforge.config import validate_config

    with pytest.raises(ConfigError, match=message):
        validate_config(LoraConfig, fields, prefix="finetune_lora")


def test_rslora_bias_and_modules_to_save_adapter_still_equals_merged(tmp_path, base_dir, qa_jsonl):
    cfg = CFG.model_copy(
        update={
            "use_rslora": True,
            "bias": "all",
            "modules_to_save": ["ln_f"],
            "layers_to_transform": [1],
            "train": CFG.train.model_copy(update={"max_steps": 4, "eval_interval": 4}),
        }
    )
    finetune_lora.run(
        cfg, base_model=base_dir, qa_uri=qa_jsonl, adapter=tmp_path / "adapter", merged_model=tmp_path / "merged"
    )
    adapter_cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["use_rslora"] and adapter_cfg["bias"] == "all" and adapter_cfg["layers_to_transform"] == [1]
    adapted = peft.PeftModel.from_pretrained(load_causal_lm(base_dir), tmp_path / "adapter").eval()
    merged = load_causal_lm(tmp_path / "merged")
    vocab = merged.config.vocab_size
    assert torch.allclose(_logits(adapted, vocab), _logits(merged, vocab), atol=1e-4)
    base_ln = load_causal_lm(base_dir).transformer.ln_f.weight
    assert not torch.equal(merged.transformer.ln_f.weight, base_ln)  # the saved module was trained


@pytest.mark.parametrize("name", ["wte", "lm_head"])
def test_tied_embedding_in_modules_to_save_trains_the_head_with_it_and_stays_tied(tmp_path, base_dir, qa_jsonl, name):
    # Named by its input side, peft used to train a copy of wte only: the head kept the base rows and
    # merging untied the two (tie_word_embeddings flipped to False).
    cfg = CFG.model_copy(
        update={
            "modules_to_save": [name],
            "train": CFG.train.model_copy(update={"max_steps": 3, "eval_interval": 3}),
        }
    )
    finetune_lora.run(
        cfg, base_model=base_dir, qa_uri=qa_jsonl, adapter=tmp_path / "adapter", merged_model=tmp_path / "merged"
    )
    base, merged = load_causal_lm(base_dir), load_causal_lm(tmp_path / "merged")
    assert merged.config.tie_word_embeddings
    assert merged.lm_head.weight is merged.transformer.wte.weight
    assert not torch.equal(merged.transformer.wte.weight, base.transformer.wte.weight)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    vocab = merged.config.vocab_size
    assert torch.allclose(_logits(adapted, vocab), _logits(merged, vocab), atol=1e-4)


def test_tied_embedding_as_lora_target_is_refused(base_dir):
    # A LoRA delta merged into the shared weight changes the head too, which the adapter never did.
    model = load_causal_lm(base_dir)
    cfg = LoraConfig(target_modules=["c_attn", "wte"])
    with pytest.raises(ConfigError, match=r"wte/lm_head is the token embedding tied to the output head"):
        finetune_lora.peft_config(cfg, model, finetune_lora.target_modules(model, cfg.target_modules))


@pytest.mark.s3
def test_base_from_s3_and_adapter_and_merged_reload_from_s3_agree(tmp_path, s3_env, base_dir, qa_jsonl):
    from lmforge import storage

    base_uri = f"s3://{s3_env}/models/base"
    storage.copy_tree(str(base_dir), base_uri)
    qa_uri = f"s3://{s3_env}/data/qa.jsonl"
    storage.upload_file(qa_jsonl, qa_uri)
    cfg = CFG.model_copy(update={"train": CFG.train.model_copy(update={"max_steps": 3, "eval_interval": 3})})
    finetune_lora.run(
        cfg, base_model=base_uri, qa_uri=qa_uri, adapter=tmp_path / "adapter", merged_model=tmp_path / "merged"
    )
    assert read_manifest(tmp_path / "merged")["inputs"]["base_model"]["uri"] == base_uri
    storage.copy_tree(str(tmp_path / "adapter"), f"s3://{s3_env}/models/adapter")
    storage.copy_tree(str(tmp_path / "merged"), f"s3://{s3_env}/models/merged")

    adapted = finetune_lora.load_adapted(base_uri, f"s3://{s3_env}/models/adapter", tmp_path / "dl")
    _, _, merged = finetune_lora.load_base(f"s3://{s3_env}/models/merged", tmp_path / "dl-merged")
    local = peft.PeftModel.from_pretrained(load_causal_lm(base_dir), tmp_path / "adapter").eval()
    vocab = merged.config.vocab_size
    expected = _logits(local, vocab)
    assert torch.allclose(_logits(adapted, vocab), expected, atol=1e-6)
    assert torch.allclose(_logits(merged, vocab), expected, atol=1e-4)


def test_base_directory_without_weights_is_a_one_line_error(tmp_path, base_dir, qa_jsonl):
    broken = shutil.copytree(base_dir, tmp_path / "noweights")
    (broken / "model.safetensors").unlink()
    with pytest.raises(InputDataError, match=r"noweights: no weights \(model\.safetensors") as info:
        finetune_lora.run(
            CFG, base_model=broken, qa_uri=qa_jsonl, adapter=tmp_path / "adapter", merged_model=tmp_path / "merged"
        )
    assert "\n" not in str(info.value)
    assert not (tmp_path / "adapter").exists()


def test_target_module_that_cannot_take_lora_is_named(tmp_path, base_dir, qa_jsonl):
    cfg = CFG.model_copy(update={"target_modules": ["ln_1"]})
    with pytest.raises(ConfigError, match=r"'ln_1' is a LayerNorm; LoRA adapts Linear") as info:
        finetune_lora.run(
            cfg, base_model=base_dir, qa_uri=qa_jsonl, adapter=tmp_path / "adapter", merged_model=tmp_path / "merged"
        )
    assert "\n" not in str(info.value)


def test_out_of_range_layers_and_unknown_modules_to_save_are_named(base_dir):
    model = load_causal_lm(base_dir)
    targets = finetune_lora.target_modules(model, None)
    with pytest.raises(ConfigError, match=r"layers_to_transform: 5 is out of range; the model has blocks 0\.\.1"):
        finetune_lora.peft_config(LoraConfig(layers_to_transform=[5]), model, targets)
    with pytest.raises(ConfigError, match=r"modules_to_save: 'score' matches no module"):
        finetune_lora.peft_config(LoraConfig(modules_to_save=["score"]), model, targets)


_ARCH_CONFIGS = {
    "gpt2": {"n_layer": 1, "n_head": 2, "n_embd": 16, "n_positions": 32},
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {}, "gemma": {}, "gemma2": {}, "phi3": {},
    "gpt_neox": {},
    "opt": {"ffn_dim": 32, "word_embed_proj_dim": 16},
}  # fmt: skip


@pytest.mark.parametrize("arch", sorted(_ARCH_CONFIGS))
def test_default_targets_exist_and_take_lora_in_each_architecture(arch):
    from transformers import AutoConfig, AutoModelForCausalLM

    common = {
        "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 32,
        "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0,
    }  # fmt: skip
    if arch in ("gpt2", "opt"):
        common = {k: v for k, v in common.items() if k.endswith("token_id") or k == "vocab_size"}
        if arch == "opt":
            common |= {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **common, **_ARCH_CONFIGS[arch]))
    targets = finetune_lora.target_modules(model, None)
    assert targets == DEFAULT_TARGETS[arch]
    adapted = peft.get_peft_model(model, finetune_lora.peft_config(LoraConfig(r=2), model, targets))
    adapted_names = {n.rsplit(".", 4)[-4] for n, p in adapted.named_parameters() if p.requires_grad}
    assert adapted_names == set(targets)


def test_architecture_without_default_targets_asks_for_them():
    shape = ModelConfig(arch="llama", n_layer=1, n_head=2, n_embd=16, block_size=32)
    model = build_model(shape, 64, eos_id=0, pad_id=1, seed=0)
    model.config.model_type = "mystery"
    with pytest.raises(ConfigError, match=r"no default for architecture 'mystery'.*set it explicitly"):
        finetune_lora.target_modules(model, None)


def test_chat_jsonl_with_packing_trains(tmp_path, base_dir):
    path = tmp_path / "chat.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(60):
            chat = [{"role": "user", "content": f"Say {i} twice."}, {"role": "assistant", "content": f"{i} {i}"}]
            fh.write(json.dumps({"messages": chat}) + "\n")
    cfg = CFG.model_copy(
        update={"packing": True, "train": CFG.train.model_copy(update={"max_steps": 6, "eval_interval": 6})}
    )
    result = finetune_lora.run(
        cfg, base_model=base_dir, qa_uri=path, adapter=tmp_path / "adapter", merged_model=tmp_path / "merged"
    )
    assert result.metrics["tuned_heldout_loss"] < result.metrics["base_heldout_loss"]
    assert read_manifest(tmp_path / "adapter")["config"]["packing"] is True
