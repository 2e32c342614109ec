"""The training loop's phases, each called on its own: one step, read back, log, evaluate, checkpoint, resume."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch

from lmforge.config import CheckpointConfig, TrainConfig
from lmforge.train.loop import TrainingRun, TrainState

X = torch.arange(64, dtype=torch.float32).view(16, 4) / 64
Y = X.sum(dim=1, keepdim=True)


def _loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    xb, yb = batch
    return torch.nn.functional.mse_loss(model(xb), yb), len(xb)


def _run(seed: int = 0, evals: list[int] | None = None, **overrides) -> TrainingRun:
    """A run of a linear regression; each evaluation appends to ``evals`` when given."""

    def eval_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
        if evals is not None:
            evals.append(1)
        return [(X, Y)]

    torch.manual_seed(seed)
    settings = {"max_steps": 8, "warmup_steps": 0, "lr": 0.1, "precision": "fp32", "log_interval": 100} | overrides
    return TrainingRun(torch.nn.Linear(4, 1), TrainConfig(**settings), _loss_fn, lambda s, m: (X, Y), eval_batches)


def _one_step(run: TrainingRun, step: int) -> None:
    """What the loop does for optimizer step ``step`` up to its bookkeeping, with the same batch every step."""
    run.set_lr(step)
    step_loss, tokens = run.forward_backward(step, SimpleNamespace(next=lambda s, m: (X, Y)))
    grad_norm, skipped = run.backend.clip()
    bad = run.backend.step(step_loss, grad_norm, skipped)
    run.acc.add(step_loss, tokens, bad, grad_norm, step + 1, run.cfg.max_bad_steps)
    run.state.window["steps"] += 1


def _checkpointed(tmp_path, seed: int) -> TrainingRun:
    checkpoint = CheckpointConfig(dir=str(tmp_path / "ckpt"), every_steps=4, every_minutes=0.0)
    return _run(seed, checkpoint=checkpoint, grad_accum=2)


def test_the_checkpoint_phase_writes_what_resume_reads(tmp_path):
    saved = _checkpointed(tmp_path, seed=0)
    for step in range(3):
        _one_step(saved, step)
    saved.read_back(3)
    saved.state.bad_in_row = 2  # as if the last two steps had been skipped
    saved.save_checkpoint(3)

    resumed = _checkpointed(tmp_path, seed=1)  # other initial weights, fresh optimizer
    assert not torch.equal(resumed.model.weight, saved.model.weight)
    resumed.resume()
    assert resumed.state.start_step == 3
    assert resumed.state.history == saved.state.history | {"resumed_from": 3}
    assert resumed.state.window == saved.state.window and resumed.state.window["steps"] == 3
    assert resumed.state.bad_in_row == 2 and resumed.acc.read()[3] == 2  # the skipped-step run goes on counting
    assert torch.equal(resumed.model.weight, saved.model.weight)
    assert torch.equal(resumed.model.bias, saved.model.bias)
    saved_adam, resumed_adam = (run.backend.optimizer.state_dict()["state"] for run in (saved, resumed))
    assert saved_adam.keys() == resumed_adam.keys()
    for index, state in saved_adam.items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], resumed_adam[index][key]), (index, key)


def test_resume_without_a_checkpoint_starts_fresh(tmp_path):
    run = _checkpointed(tmp_path, seed=0)
    run.resume()
    assert run.state == TrainState()


def test_evaluation_runs_only_on_its_interval_and_after_the_last_step():
    evals: list[int] = []
    run = _run(evals=evals, max_steps=7, eval_interval=3)
    for step in range(7):
        _one_step(run, step)
        run.end_step(step + 1, run.set_lr(step), checkpoint=False, stop=False)
    assert run.state.history["eval_step"] == [3, 6, 7]
    assert len(evals) == 3
    assert run.state.history["step"] == [7]  # logging (interval 100) is due only after the last step


def test_the_log_phase_reports_the_window_mean_loss_tokens_per_second_and_mfu(caplog):
    run = _run(peak_flops=1e12)
    run.flops_per_token = 2e6
    run.state.window = {"loss": 7.5, "steps": 3, "tokens": 6000, "seconds": 2.0}
    record = {"lr": 0.05, "loss": 2.4, "grad_norm": 0.5}
    with caplog.at_level(logging.INFO, logger="lmforge.train"):
        run.log(3, 0.05, record)
    assert record["train_loss"] == 2.5  # the window's mean, not the last step's 2.4
    assert record["tokens_per_sec"] == 3000.0
    assert record["mfu"] == pytest.approx(3000 * 2e6 / 1e12)
    history = run.state.history
    assert (history["step"], history["train_loss"], history["lr"]) == ([3], [2.5], [0.05])
    assert (history["grad_norm"], history["tokens_per_sec"], history["mfu"]) == ([0.5], [3000.0], [record["mfu"]])
    assert run.state.window == {"loss": 0.0, "steps": 0, "tokens": 0, "seconds": 0.0}  # a new window opens
    assert "train step 3/8: loss 2.5000, lr 0.05, grad norm 0.5, 3000 tokens/s, MFU 0.6%" in caplog.text


def test_the_log_phase_has_no_mfu_without_a_flops_figure():
    run = _run(peak_flops=1e12)
    run.state.window = {"loss": 1.0, "steps": 1, "tokens": 10, "seconds": 0.0}
    record = {"lr": 0.1, "loss": 1.0, "grad_norm": 0.5}
    run.log(1, 0.1, record)
    assert record["mfu"] is None and record["tokens_per_sec"] == pytest.approx(10 / 1e-9)


def test_read_back_keeps_a_compiled_first_step_out_of_the_window():
    run = _run()
    _one_step(run, 0)
    run.read_back(1, warmup=True)
    _one_step(run, 1)
    run.read_back(2)
    history, window = run.state.history, run.state.window
    assert history["warmup_tokens"] == 16 and window["tokens"] == 16
    assert history["total_tokens"] == 32
    assert history["train_seconds"] == pytest.approx(history["warmup_seconds"] + window["seconds"])
    assert window["steps"] == 2 and math.isfinite(window["loss"])


@pytest.mark.parametrize("fused", [True, False])
def test_the_step_phase_skips_a_non_finite_step_and_leaves_the_weights_alone(fused):
    run = _run(fused_optimizer=fused)
    assert run.backend.device_guard is fused
    before = run.model.weight.detach().clone()
    run.set_lr(0)
    step_loss, _ = run.forward_backward(0, SimpleNamespace(next=lambda s, m: (X * math.nan, Y)))
    grad_norm, skipped = run.backend.clip()
    assert float(run.backend.step(step_loss, grad_norm, skipped)) == 1.0
    assert torch.equal(run.model.weight, before)
    assert all(p.grad is None for p in run.model.parameters())  # and the next step starts from zero gradients
