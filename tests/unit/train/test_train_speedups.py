"""The loop's speed-ups change no numbers: fused GELU, fused CE, fused AdamW, no per-step sync, prefetch, compile."""

from __future__ import annotations

import functools
import threading
import time

import numpy as np
import pytest
import torch

from lmforge.config import ModelConfig, TrainConfig
from lmforge.model.build import FUSED_GPT2_GELU, build_model, set_gpt2_activation
from lmforge.train.batches import Prefetcher, random_windows
from lmforge.train.loop import tokens_per_sec, train
from lmforge.train.losses import causal_lm_loss

VOCAB = 97
SHAPE = ModelConfig(arch="gpt2", n_layer=2, n_head=2, n_embd=32, block_size=32)
TOKENS = np.random.default_rng(0).integers(0, VOCAB, 20_000).astype(np.uint16)
EAGER = {"fused_optimizer": False, "prefetch_batches": 0, "compile": False, "log_interval": 1}


def _model(activation: str = FUSED_GPT2_GELU) -> torch.nn.Module:
    model = build_model(SHAPE, VOCAB, eos_id=0, pad_id=1, seed=5)
    set_gpt2_activation(model, activation)
    return model


def _batch(step: int, micro: int) -> dict[str, torch.Tensor]:
    return random_windows(TOKENS, batch_size=4, seq_len=32, seed=0, step=step, micro=micro, grad_accum=2)


def _train(activation: str, steps: int = 50, fused_ce: bool = True, **overrides) -> dict:
    cfg = TrainConfig(
        max_steps=steps, batch_size=4, grad_accum=2, seq_len=32, lr=3e-3, min_lr=3e-4, warmup_steps=5,
        precision="fp32", eval_interval=steps, eval_batches=1, seed=0, **overrides,
    )  # fmt: skip
    loss_fn = functools.partial(causal_lm_loss, fused_ce=fused_ce)
    return train(_model(activation), cfg, loss_fn, _batch, lambda: [_batch(0, 0)])


def test_new_gpt2_models_use_the_fused_tanh_gelu_with_gelu_new_logits_within_1e5():
    fused, reference = _model(), _model("gelu_new")
    assert fused.config.activation_function == FUSED_GPT2_GELU
    ids = torch.from_numpy(TOKENS[:64].astype(np.int64)).view(2, 32)
    with torch.no_grad():
        difference = (fused(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max().item()
    assert difference < 1e-5


def test_fused_cross_entropy_matches_autograd_loss_and_gradient_with_ignored_positions():
    from lmforge.train.losses import masked_ce

    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7))
    targets[0, :4] = -100
    grads = []
    for fused in (True, False):
        logits.grad = None
        loss = masked_ce(logits, targets, fused=fused)
        (2.5 * loss).backward()
        grads.append((loss.detach(), logits.grad.clone()))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-6)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-7)
    assert grads[0][1][0, :4].abs().sum() == 0  # ignored positions get no gradient
    loss = masked_ce(logits, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fifty_steps_with_every_speed_up_match_eager_fp32_within_1e4_per_step(compiled):
    eager = _train("gelu_new", fused_ce=False, **EAGER)
    fast = _train(FUSED_GPT2_GELU, fused_optimizer=True, prefetch_batches=2, compile=compiled, log_interval=1)
    worst = max(abs(a - b) for a, b in zip(eager["train_loss"], fast["train_loss"], strict=True))
    assert len(fast["train_loss"]) == 50 and worst < 1e-4, f"max |Δloss| {worst:.2e}"
    assert eager["eval_loss"][-1] == pytest.approx(fast["eval_loss"][-1], abs=1e-4)
    if compiled:  # the compiling first step is timed apart and left out of the throughput
        assert fast["warmup_seconds"] > 0 and fast["warmup_tokens"] == 4 * 2 * 32
        assert tokens_per_sec(fast) == pytest.approx(
            (fast["total_tokens"] - fast["warmup_tokens"]) / (fast["train_seconds"] - fast["warmup_seconds"])
        )


def test_logging_every_ten_steps_reports_the_means_of_the_per_step_losses():
    every_step = _train(FUSED_GPT2_GELU, steps=20, log_interval=1)
    every_ten = _train(FUSED_GPT2_GELU, steps=20, log_interval=10)
    assert every_ten["step"] == [10, 20]
    means = [float(np.mean(every_step["train_loss"][i : i + 10])) for i in (0, 10)]
    assert every_ten["train_loss"] == pytest.approx(means, abs=1e-9)
    assert every_ten["total_tokens"] == every_step["total_tokens"] == 20 * 2 * 4 * 32


def test_throughput_counts_every_step_of_the_window_not_only_the_last():
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def slow_loss(m, batch):
        time.sleep(0.01)  # at least 10 ms per step, so a 5-step window takes at least 50 ms
        return torch.nn.functional.mse_loss(m(batch[0]), batch[1]), 8

    cfg = TrainConfig(max_steps=10, warmup_steps=0, precision="fp32", eval_interval=10, log_interval=5)
    history = train(model, cfg, slow_loss, lambda s, m: (x, y), lambda: [(x, y)])
    assert history["train_seconds"] >= 10 * 0.01
    assert all(rate <= 5 * 8 / (5 * 0.01) for rate in history["tokens_per_sec"])


def test_prefetcher_yields_the_batches_of_the_loop_in_order_from_the_resume_step():
    calls: list[tuple[int, int, str]] = []

    def make(step: int, micro: int) -> tuple[int, int]:
        calls.append((step, micro, threading.current_thread().name))
        return step, micro

    with Prefetcher(make, start_step=3, max_steps=6, grad_accum=2, depth=2) as batches:
        got = [batches.next(step, micro) for step in range(3, 6) for micro in range(2)]
    assert got == [(s, m) for s in range(3, 6) for m in range(2)]
    assert {name for *_, name in calls} == {"lmforge-prefetch"}


def test_prefetcher_raises_the_batch_error_in_the_caller():
    def make(step: int, micro: int) -> int:
        if step == 1:
            raise ValueError("shard 7 is truncated")
        return step

    with Prefetcher(make, start_step=0, max_steps=3, grad_accum=1, depth=2) as batches:
        assert batches.next(0, 0) == 0
        with pytest.raises(ValueError, match="shard 7 is truncated"):
            batches.next(1, 0)


def test_prefetcher_stops_its_thread_when_training_stops_early():
    with Prefetcher(lambda s, m: s, start_step=0, max_steps=10_000, grad_accum=1, depth=2) as batches:
        batches.next(0, 0)
    assert not any(t.name == "lmforge-prefetch" for t in threading.enumerate())
