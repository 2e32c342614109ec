"""Base models from outside: what check_base_model accepts and refuses, and tokenize/pretrain starting from one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM, PreTrainedTokenizerFast

from lmforge import storage
from lmforge.artifacts import read_manifest
from lmforge.config import CleanConfig, ModelConfig, PretrainConfig, TokenizeConfig, TrainConfig
from lmforge.data import clean, tokenize
from lmforge.errors import ConfigError, InputDataError
from lmforge.formats.cleaned import read_cleaned
from lmforge.formats.token_shards import TokenShards
from lmforge.model.base import base_tokenizer, check_base_model
from lmforge.model.build import load_tokenizer
from lmforge.train import pretrain
from lmforge.train.batches import random_windows
from tests.support.foreign_base import GPT2_VOCAB, gpt2_base, llama_base

TRAIN = TrainConfig(
    max_steps=3, batch_size=2, seq_len=32, lr=3e-3, min_lr=3e-4, warmup_steps=1, precision="fp32",
    eval_interval=3, eval_batches=1, log_interval=1,
)  # fmt: skip


@pytest.fixture(scope="module")
def texts(shakespeare_docs) -> list[str]:
    return [d["text"] for d in shakespeare_docs]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, texts) -> Path:
    return gpt2_base(tmp_path_factory.mktemp("gpt2-base"), texts)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, texts) -> Path:
    return llama_base(tmp_path_factory.mktemp("llama-base"), texts)


@pytest.fixture(scope="module")
def cleaned(tmp_path_factory, shakespeare_docs) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    with open(root / "corpus.jsonl", "w", encoding="utf-8") as fh:
        for doc in shakespeare_docs[:20]:
            fh.write(json.dumps({"text": doc["text"]}) + "\n")
    clean.run(CleanConfig(min_chars=20, min_words=3), corpus_uri=str(root / "corpus.jsonl"), cleaned=root / "cleaned")
    return root / "cleaned"


def _copy_without(src: Path, dst: Path, *names: str) -> Path:
    shutil.copytree(src, dst)
    for name in names:
        (dst / name).unlink()
    return dst


def test_gpt2_and_llama_bases_written_by_plain_save_pretrained_are_ok(gpt2_dir, llama_dir):
    assert check_base_model(str(gpt2_dir)) == "ok"
    assert check_base_model(str(llama_dir)) == "ok"
    assert not (gpt2_dir / "manifest.json").exists()


def test_an_architecture_lmforge_does_not_build_is_refused_with_the_reason(tmp_path, gpt2_dir):
    out = tmp_path / "opt"
    OPTForCausalLM(
        OPTConfig(vocab_size=800, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2)
    ).save_pretrained(out)
    load_tokenizer(gpt2_dir).save_pretrained(out)
    reason = check_base_model(str(out))
    assert "architecture 'opt' (OPTForCausalLM) is not supported" in reason and "gpt2 and llama" in reason


@pytest.mark.parametrize(
    ("remove", "expected"),
    [
        ("tokenizer.json", "no tokenizer.json"),
        ("model.safetensors", "no safetensors weights"),
        ("config.json", "no config.json"),
    ],
)
def test_a_base_missing_a_file_is_refused_naming_it(tmp_path, gpt2_dir, remove, expected):
    assert expected in check_base_model(str(_copy_without(gpt2_dir, tmp_path / "base", remove)))


def test_pickled_weights_only_are_refused_and_named(tmp_path, gpt2_dir):
    import torch

    out = _copy_without(gpt2_dir, tmp_path / "pickled", "model.safetensors")
    torch.save(GPT2LMHeadModel.from_pretrained(gpt2_dir).state_dict(), out / "pytorch_model.bin")
    reason = check_base_model(str(out))
    assert "no safetensors weights" in reason and "pytorch_model.bin are pickles, which lmforge never loads" in reason


def test_a_tokenizer_larger_than_the_embedding_or_without_eos_is_refused(tmp_path, gpt2_dir):
    small = tmp_path / "small"
    GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=64, n_embd=16, n_layer=1, n_head=2)).save_pretrained(small)
    load_tokenizer(gpt2_dir).save_pretrained(small)
    assert f"the tokenizer has {GPT2_VOCAB} tokens but the model only 300 embedding rows" in check_base_model(
        str(small)
    )

    no_eos = _copy_without(gpt2_dir, tmp_path / "no-eos")
    raw = Tokenizer.from_file(str(gpt2_dir / "tokenizer.json"))
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>").save_pretrained(no_eos)
    assert "the tokenizer has no eos_token" in check_base_model(str(no_eos))


def test_an_unreadable_uri_is_a_reason_not_an_exception(tmp_path):
    assert "no such file or directory" in check_base_model(str(tmp_path / "missing"))


def test_a_tokenizer_without_padding_pads_with_its_eos(gpt2_dir):
    tokenizer = base_tokenizer(gpt2_dir)
    assert load_tokenizer(gpt2_dir).pad_token is None
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("</s>", "</s>")


@pytest.mark.s3
def test_a_base_on_s3_is_checked_from_its_config_and_tokenizer(s3_env, gpt2_dir):
    uri = f"s3://{s3_env}/bases/gpt2"
    storage.copy_tree(str(gpt2_dir), uri)
    assert check_base_model(uri) == "ok"
    storage.delete(storage.join(uri, "tokenizer.json"))
    assert "no tokenizer.json" in check_base_model(uri)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_tokenize_with_a_base_writes_the_base_tokenizer_and_eos_joined_shards(
    tmp_path, cleaned, gpt2_dir, llama_dir, family
):
    base = gpt2_dir if family == "gpt2" else llama_dir
    result = tokenize.run(
        TokenizeConfig(val_fraction=0.2), cleaned=cleaned, tokenizer=tmp_path / "tok", shards=tmp_path / "shards",
        base_model=str(base),
    )  # fmt: skip
    written, original = load_tokenizer(tmp_path / "tok"), load_tokenizer(base)
    assert written.get_vocab() == original.get_vocab() and written.eos_token == original.eos_token == "</s>"
    assert written.pad_token == "</s>"  # the documented choice for a base without a padding token
    manifest = read_manifest(tmp_path / "tok", verify=True)
    assert manifest["source"] == "base_model" and manifest["inputs"]["base_model"]["uri"] == str(base)
    assert result.metrics["vocab_size"] == len(original)
    shards = TokenShards.open(tmp_path / "shards")
    assert shards.eos_id == original.eos_token_id and shards.dtype == np.uint16
    tokens = np.asarray(shards.tokens("train"))
    starts = np.flatnonzero(tokens == shards.eos_id)[:-1] + 1
    bos = original.bos_token_id
    # documents are joined by EOS only: the Llama tokenizer's own BOS is not added per document
    assert tokens[0] != bos and not np.any(tokens[starts] == bos)


def test_a_vocabulary_above_65536_tokens_gets_uint32_shards_that_read_back(tmp_path, cleaned):
    words = sorted({w for row in read_cleaned(cleaned) for w in row["text"].split()})
    vocab = {"</s>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    vocab |= {f"<extra_{i}>": len(vocab) + i for i in range(70_000 - len(vocab))}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    base = tmp_path / "big"
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>").save_pretrained(base)
    GPT2LMHeadModel(GPT2Config(vocab_size=70_000, n_positions=64, n_embd=8, n_layer=1, n_head=2)).save_pretrained(base)
    assert check_base_model(str(base)) == "ok"
    tokenize.run(
        TokenizeConfig(val_fraction=0.2), cleaned=cleaned, tokenizer=tmp_path / "tok", shards=tmp_path / "shards",
        base_model=str(base),
    )  # fmt: skip
    shards = TokenShards.open(tmp_path / "shards", verify=True)
    assert shards.dtype == np.uint32 and shards.index["dtype"] == "uint32" and shards.vocab_size == 70_000
    tokens = shards.tokens("train")
    assert int(np.asarray(tokens).max()) < len(vocab) and tokens[-1] == 0
    batch = random_windows(tokens, batch_size=2, seq_len=16, seed=0, step=0)
    assert batch["input_ids"].dtype.is_floating_point is False and int(batch["input_ids"].max()) < 70_000


@pytest.fixture(scope="module")
def gpt2_tokens(tmp_path_factory, cleaned, gpt2_dir) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gpt2-tokens")
    tokenize.run(
        TokenizeConfig(val_fraction=0.2), cleaned=cleaned, tokenizer=root / "tok", shards=root / "shards",
        base_model=str(gpt2_dir),
    )  # fmt: skip
    return root / "tok", root / "shards"


def test_pretrain_refuses_a_tokenizer_that_is_not_the_base_models(tmp_path, gpt2_tokens, llama_dir):
    tok, shards = gpt2_tokens
    cfg = PretrainConfig(train=TRAIN)
    with pytest.raises(InputDataError, match=r"is not the base model .*'s \(vocabularies differ") as info:
        pretrain.run(cfg, shards=shards, tokenizer=tok, model=tmp_path / "out", base_model=str(llama_dir))
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("base_model", [None, ""])  # "": an unset pipeline parameter
def test_pretrain_with_zero_steps_needs_a_base_model(tmp_path, gpt2_tokens, base_model):
    tok, shards = gpt2_tokens
    cfg = PretrainConfig(
        model=ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=64),
        train=TRAIN.model_copy(update={"max_steps": 0}),
    )
    with pytest.raises(ConfigError, match="max_steps is 0, which passes a base model through untrained"):
        pretrain.run(cfg, shards=shards, tokenizer=tok, model=tmp_path / "out", base_model=base_model)


def test_pretrain_refuses_a_sequence_longer_than_the_base_positions(tmp_path, gpt2_tokens, gpt2_dir):
    tok, shards = gpt2_tokens
    cfg = PretrainConfig(
        model=ModelConfig(block_size=256), train=TRAIN.model_copy(update={"seq_len": 200, "max_steps": 1})
    )
    with pytest.raises(ConfigError, match=r"seq_len \(200\) exceeds the base model's 128 positions"):
        pretrain.run(cfg, shards=shards, tokenizer=tok, model=tmp_path / "out", base_model=str(gpt2_dir))


def test_a_config_that_is_not_json_is_a_reason_naming_the_file(tmp_path, gpt2_dir):
    broken = _copy_without(gpt2_dir, tmp_path / "broken")
    (broken / "config.json").write_text("{not json", encoding="utf-8")
    reason = check_base_model(str(broken))
    assert "config.json: not valid JSON" in reason and "\n" not in reason
