"""The shared training loop: schedule, weight-decay groups, batches and history."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from lmforge.config import TrainConfig
from lmforge.errors import InputDataError
from lmforge.train.batches import eval_windows, random_windows
from lmforge.train.loop import lr_at, param_groups, train


def test_lr_warms_up_linearly_then_decays_by_cosine_to_min_lr():
    cfg = TrainConfig(max_steps=13, warmup_steps=4, lr=1e-3, min_lr=1e-4)
    assert lr_at(0, cfg) == pytest.approx(2.5e-4)
    assert lr_at(1, cfg) == pytest.approx(5e-4)
    assert lr_at(3, cfg) == pytest.approx(1e-3)
    assert lr_at(4, cfg) == pytest.approx(1e-3)  # decay starts at the peak
    # 8 decay steps (4..12): a quarter of the way, half way, the end
    assert lr_at(6, cfg) == pytest.approx(1e-4 + 0.5 * (1 + math.sqrt(0.5)) * 9e-4)
    assert lr_at(8, cfg) == pytest.approx(5.5e-4)
    assert lr_at(12, cfg) == pytest.approx(1e-4)


def test_lr_without_warmup_starts_at_peak():
    cfg = TrainConfig(max_steps=5, warmup_steps=0, lr=2e-3, min_lr=0.0)
    assert [lr_at(s, cfg) for s in (0, 2, 4)] == pytest.approx([2e-3, 1e-3, 0.0])


def _names(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> set[str]:
    ids = {id(p) for p in params}
    return {name for name, p in model.named_parameters() if id(p) in ids}


def test_weight_decay_only_on_gpt2_matrices_not_biases_norms_or_embeddings():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, n_positions=16, vocab_size=32))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert _names(model, decay["params"]) == {
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.0.attn.c_proj.weight",
        "transformer.h.0.mlp.c_fc.weight",
        "transformer.h.0.mlp.c_proj.weight",
    }
    no_decay_names = _names(model, no_decay["params"])
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight"} <= no_decay_names
    assert "transformer.h.0.attn.c_attn.bias" in no_decay_names
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_weight_decay_groups_exclude_llama_rmsnorm_and_embeddings():
    config = LlamaConfig(
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        hidden_size=8,
        intermediate_size=16,
        vocab_size=32,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    decay, no_decay = param_groups(model, 0.1)
    assert "model.layers.0.self_attn.q_proj.weight" in _names(model, decay["params"])
    assert "lm_head.weight" in _names(model, decay["params"])  # untied head is a plain matrix
    assert {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
    } <= _names(model, no_decay["params"])


def test_batches_are_reproducible_from_seed_and_step():
    tokens = np.arange(1000, dtype=np.uint16)
    kwargs = {"batch_size": 4, "seq_len": 8, "seed": 7}
    a = random_windows(tokens, step=3, micro=1, **kwargs)
    b = random_windows(tokens, step=3, micro=1, **kwargs)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["targets"], b["targets"])
    assert not torch.equal(a["input_ids"], random_windows(tokens, step=4, micro=1, **kwargs)["input_ids"])
    assert not torch.equal(a["input_ids"], random_windows(tokens, step=3, micro=0, **kwargs)["input_ids"])
    assert a["input_ids"].dtype == torch.int64 and a["input_ids"].shape == (4, 8)
    assert torch.equal(a["targets"], a["input_ids"] + 1)  # consecutive ids: targets are shifted inputs


def test_eval_windows_are_fixed_and_span_the_split():
    tokens = np.arange(100, dtype=np.uint16)
    batches = eval_windows(tokens, batch_size=2, seq_len=9, n_batches=2)
    starts = [int(row[0]) for b in batches for row in b["input_ids"]]
    assert starts == [0, 30, 60, 90]
    with pytest.raises(InputDataError, match="val split has 5 tokens"):
        eval_windows(tokens[:5], batch_size=1, seq_len=9, n_batches=1)


def test_loop_history_is_json_and_follows_log_and_eval_intervals():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(64, 4), torch.randn(64, 1)

    def loss_fn(m, batch):
        xb, yb = batch
        return torch.nn.functional.mse_loss(m(xb), yb), len(xb)

    def train_batch(step, micro):
        rows = torch.arange(8) + 8 * ((2 * step + micro) % 8)
        return x[rows], y[rows]

    cfg = TrainConfig(
        max_steps=5, warmup_steps=1, grad_accum=2, lr=0.1, min_lr=0.01, precision="fp32",
        eval_interval=2, log_interval=2,
    )  # fmt: skip
    history = train(model, cfg, loss_fn, train_batch, lambda: [(x, y)])
    json.dumps(history)
    assert history["eval_step"] == [0, 2, 4, 5]
    assert history["step"] == [2, 4, 5]
    assert history["lr"][-1] == pytest.approx(0.01)
    assert history["total_tokens"] == 5 * 2 * 8
    assert history["eval_loss"][-1] < history["eval_loss"][0]
    assert not model.training


def test_loop_runs_under_bf16_autocast_on_cpu():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    cfg = TrainConfig(max_steps=3, warmup_steps=0, precision="bf16", eval_interval=3, log_interval=1)

    def loss_fn(m, batch):
        return torch.nn.functional.mse_loss(m(batch[0]).float(), batch[1]), 16

    history = train(model, cfg, loss_fn, lambda s, m: (x, y), lambda: [(x, y)])
    assert all(math.isfinite(v) for v in history["train_loss"] + history["grad_norm"])
    assert model[0].weight.dtype == torch.float32  # autocast leaves master weights in fp32
