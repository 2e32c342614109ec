"""The shared training loop: schedule, weight-decay groups, batches and history."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from lmforge.config import ModelConfig, TrainConfig
from lmforge.errors import InputDataError
from lmforge.model.build import hf_config
from lmforge.train.batches import eval_windows, random_windows
from lmforge.train.loop import NonFiniteLossError, lr_at, param_groups, sigterm_flag, train
from lmforge.train.mfu import device_peak_flops, flops_per_token, mfu, model_flops_per_token


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
    config = hf_config(ModelConfig(arch="llama", n_layer=1, n_head=2, n_embd=8, block_size=16), 32, eos_id=0, pad_id=1)
    config.tie_word_embeddings = False  # lmforge ties the head; a base model may not
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
    kwargs = {"batch_size": 4, "seq_len": 8, "seed": 7, "grad_accum": 2}
    a = random_windows(tokens, step=3, micro=1, **kwargs)
    b = random_windows(tokens, step=3, micro=1, **kwargs)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["targets"], b["targets"])
    assert not torch.equal(a["input_ids"], random_windows(tokens, step=4, micro=1, **kwargs)["input_ids"])
    assert not torch.equal(a["input_ids"], random_windows(tokens, step=3, micro=0, **kwargs)["input_ids"])
    assert a["input_ids"].dtype == torch.int64 and a["input_ids"].shape == (4, 8)
    assert torch.equal(a["targets"], a["input_ids"] + 1)  # consecutive ids: targets are shifted inputs


def _rows(batches: list[dict[str, torch.Tensor]]) -> list[tuple[int, ...]]:
    return sorted(tuple(row.tolist()) for b in batches for row in b["input_ids"])


@pytest.mark.parametrize(("batch_size", "grad_accum", "world_size"), [(2, 4, 1), (4, 1, 2), (2, 2, 2), (1, 2, 4)])
def test_global_batch_is_the_same_set_of_windows_however_it_is_split(batch_size, grad_accum, world_size):
    tokens = np.arange(5000, dtype=np.uint16)
    reference = [random_windows(tokens, batch_size=8, seq_len=16, seed=3, step=11)]
    split = [
        random_windows(
            tokens, batch_size=batch_size, seq_len=16, seed=3, step=11, micro=m, grad_accum=grad_accum,
            rank=r, world_size=world_size,
        )
        for m in range(grad_accum)
        for r in range(world_size)
    ]  # fmt: skip
    assert _rows(split) == _rows(reference)
    ranks = [
        _rows([random_windows(tokens, batch_size=4, seq_len=16, seed=3, step=11, rank=r, world_size=2)])
        for r in range(2)
    ]
    assert not set(ranks[0]) & set(ranks[1])  # ranks see disjoint windows


def test_out_of_range_micro_or_rank_is_refused():
    tokens = np.arange(100, dtype=np.uint16)
    with pytest.raises(ValueError, match="rank 2 out of range"):
        random_windows(tokens, batch_size=1, seq_len=4, seed=0, step=0, rank=2, world_size=2)


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


def _regression(nan_at: set[int]):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def loss_fn(m, batch):
        step, (xb, yb) = batch
        loss = torch.nn.functional.mse_loss(m(xb), yb)
        return (loss * float("nan") if int(step) in nan_at else loss), len(xb)

    return model, loss_fn, (lambda s, m: (torch.tensor(s), (x, y))), (lambda: [(torch.tensor(-1), (x, y))])


@pytest.mark.parametrize(
    ("nan_at", "settings", "bad_steps"),
    [
        ({1, 2}, {"max_steps": 5, "eval_interval": 5, "log_interval": 1, "max_bad_steps": 3}, 2),
        # no per-step sync: skipped on the device, counted at the next log step
        ({1, 2, 6}, {"max_steps": 10, "eval_interval": 10, "log_interval": 5}, 3),
    ],
    ids=["logged_every_step", "counted_at_the_next_log"],
)
def test_non_finite_steps_are_skipped_and_counted(nan_at, settings, bad_steps):
    model, loss_fn, batch, evals = _regression(nan_at)
    cfg = TrainConfig(warmup_steps=0, precision="fp32", **settings)
    before = model.weight.detach().clone()
    history = train(model, cfg, loss_fn, batch, evals)
    assert history["bad_steps"] == bad_steps
    assert all(math.isfinite(v) for v in model.weight.detach().flatten().tolist())
    assert not torch.equal(model.weight, before)


@pytest.mark.parametrize(
    ("steps", "log_interval", "match"),
    [
        (8, 1, r"3 consecutive steps \(up to step 5\).*max_bad_steps=3"),
        # an abort between log steps names the step where the limit was reached
        (9, 9, r"3 consecutive steps \(up to step 5\)"),
    ],
    ids=["logged_every_step", "between_log_steps"],
)
def test_too_many_non_finite_steps_in_a_row_abort_with_a_clear_error(steps, log_interval, match):
    model, loss_fn, batch, evals = _regression({2, 3, 4})
    cfg = TrainConfig(
        max_steps=steps, warmup_steps=0, precision="fp32", eval_interval=steps, log_interval=log_interval,
        max_bad_steps=3,
    )  # fmt: skip
    with pytest.raises(NonFiniteLossError, match=match):
        train(model, cfg, loss_fn, batch, evals)


def test_gradient_checkpointing_gives_the_same_losses():
    from lmforge.train.losses import causal_lm_loss

    tokens = np.arange(2000, dtype=np.uint16) % 97
    losses = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=32, vocab_size=97))
        cfg = TrainConfig(
            max_steps=3, warmup_steps=0, batch_size=2, seq_len=16, precision="fp32", eval_interval=3,
            log_interval=1, grad_checkpointing=checkpointing,
        )  # fmt: skip

        def batch(step, micro):
            return random_windows(tokens, batch_size=2, seq_len=16, seed=0, step=step)

        losses.append(train(model, cfg, causal_lm_loss, batch, lambda: [batch(0, 0)])["train_loss"])
        assert getattr(model, "is_activation_checkpointing", None) == checkpointing
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)


def test_mfu_uses_palm_flops_per_token():
    # 6·N + 12·L·H·Q·T with N = 1e6, L = 2, H = 4, Q = 16, T = 128
    assert flops_per_token(1_000_000, 2, 4, 16, 128) == 6e6 + 12 * 2 * 4 * 16 * 128
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=32, vocab_size=97))
    n = sum(p.numel() for p in model.parameters()) - 32 * 16  # position table excluded
    assert model_flops_per_token(model, 32) == 6 * n + 12 * 2 * 2 * 8 * 32
    assert mfu(1000.0, 1e9, 1e13, world_size=2) == pytest.approx(0.05)
    assert device_peak_flops(torch.device("cpu"), None) is None
    assert device_peak_flops(torch.device("cpu"), 2e12) == 2e12


def test_sigterm_flag_is_set_by_the_signal_and_the_handler_restored():
    import os
    import signal

    before = signal.getsignal(signal.SIGTERM)
    with sigterm_flag(True) as flag:
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.wait(5)
    assert signal.getsignal(signal.SIGTERM) is before
