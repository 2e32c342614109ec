"""The one training loop shared by ``pretrain``, ``finetune_lora`` and ``distill``.

A stage hands :func:`train` a model, a :class:`~lmforge.config.TrainConfig` and three callables:

* ``loss_fn(model, batch) -> (loss, n_tokens)``: the scalar loss of one micro-batch (mean over its
  scored tokens) and how many tokens it scored;
* ``train_batch(step, micro) -> batch``: the micro-batch ``micro`` of optimizer step ``step``,
  deterministic in (seed, step, micro) so that a resumed run sees the same data;
* ``eval_batches() -> iterable of batches``: the fixed validation set.

The loop is AdamW with decoupled weight decay on matrices only, linear warmup then cosine decay,
gradient accumulation, global-norm clipping and autocast (``GradScaler`` only for fp16). It returns
a JSON-serializable history. Everything happens in :func:`train`, top to bottom, so that
distributed training and resumption can be added in one place.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from tqdm.auto import tqdm

from lmforge.config import TrainConfig

logger = logging.getLogger("lmforge.train")

LossFn = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, int]]

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def default_device() -> torch.device:
    """The first CUDA device when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based).

    Linear warmup ``lr·(step+1)/warmup_steps`` for the first ``warmup_steps`` steps, then cosine decay
    from ``lr`` at step ``warmup_steps`` to exactly ``min_lr`` at the last step ``max_steps - 1``.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.max_steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on trainable ≥2-D weights, none on biases, norms and embeddings.

    Embedding tables are excluded because decay pulls rarely seen tokens' rows to zero; tied output
    heads share the embedding tensor and so are excluded with it.
    """
    no_decay_ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) or "norm" in type(module).__name__.lower():
            no_decay_ids.update(id(p) for p in module.parameters(recurse=False))
    decay, no_decay = [], []
    for param in model.parameters():  # yields each shared (tied) tensor once
        if not param.requires_grad:
            continue
        if param.ndim >= 2 and id(param) not in no_decay_ids:
            decay.append(param)
        else:
            no_decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast to bf16/fp16 on ``device``; a no-op for fp32."""
    if precision not in _AUTOCAST_DTYPES:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_AUTOCAST_DTYPES[precision])


def to_device(batch: Any, device: torch.device) -> Any:
    """Move the tensors of a batch (a tensor, mapping, list or tuple of them) to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


@torch.no_grad()
def evaluate(model: torch.nn.Module, loss_fn: LossFn, batches: Iterable[Any], *, precision: str) -> float:
    """Token-weighted mean of ``loss_fn`` over ``batches``, in eval mode (the mode is restored)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        with autocast(precision, device):
            loss, n_tokens = loss_fn(model, to_device(batch, device))
        total += float(loss) * int(n_tokens)
        count += int(n_tokens)
    model.train(was_training)
    if count == 0:
        raise ValueError("evaluation batches scored no tokens")
    return total / count


def train(
    model: torch.nn.Module,
    cfg: TrainConfig,
    loss_fn: LossFn,
    train_batch: Callable[[int, int], Any],
    eval_batches: Callable[[], Iterable[Any]],
    *,
    eval_loss_fn: LossFn | None = None,
    desc: str = "train",
) -> dict[str, Any]:
    """Optimize ``model`` in place for ``cfg.max_steps`` steps; return the history.

    Args:
        model: parameters with ``requires_grad`` are trained, on the device the model is on.
        cfg: optimizer, schedule, precision and logging settings.
        loss_fn: ``(model, batch) -> (mean loss, scored tokens)`` for training micro-batches.
        train_batch: ``(step, micro) -> batch``; tensors are moved to the model's device here.
        eval_batches: returns the validation batches; evaluated before training (``eval_step`` 0),
            every ``cfg.eval_interval`` steps and after the last step.
        eval_loss_fn: loss for validation when it differs from the training loss (default ``loss_fn``).
        desc: progress-bar label.

    Returns:
        ``step``, ``train_loss``, ``lr``, ``grad_norm``, ``tokens_per_sec``, ``elapsed_s`` (one entry per
        ``cfg.log_interval`` steps, losses averaged over the interval); ``eval_step``, ``eval_loss``;
        ``total_tokens`` and ``train_seconds`` (training time without evaluation).
    """
    device = next(model.parameters()).device
    eval_loss_fn = eval_loss_fn or loss_fn
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    # Loss scaling only where fp16's narrow range needs it; bf16 and fp32 never underflow like that.
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf

    history: dict[str, Any] = {
        key: [] for key in ("step", "train_loss", "lr", "grad_norm", "tokens_per_sec", "elapsed_s", "eval_step")
    }
    history["eval_loss"] = []

    def run_eval(step: int) -> None:
        loss = evaluate(model, eval_loss_fn, eval_batches(), precision=cfg.precision)
        history["eval_step"].append(step)
        history["eval_loss"].append(loss)
        logger.info("%s step %d: eval loss %.4f", desc, step, loss)

    run_eval(0)
    model.train()
    start = time.perf_counter()
    train_seconds, total_tokens = 0.0, 0
    window_loss, window_steps, window_tokens, window_seconds = 0.0, 0, 0, 0.0
    for step in tqdm(range(cfg.max_steps), desc=desc, disable=None, dynamic_ncols=True):
        step_start = time.perf_counter()
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_loss, step_tokens = 0.0, 0
        for micro in range(cfg.grad_accum):
            batch = to_device(train_batch(step, micro), device)
            with autocast(cfg.precision, device):
                loss, n_tokens = loss_fn(model, batch)
            scaler.scale(loss / cfg.grad_accum).backward()
            step_loss += float(loss.detach()) / cfg.grad_accum
            step_tokens += int(n_tokens)
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, max_norm))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # honest step timing
        step_seconds = time.perf_counter() - step_start

        train_seconds += step_seconds
        total_tokens += step_tokens
        window_loss += step_loss
        window_steps += 1
        window_tokens += step_tokens
        window_seconds += step_seconds
        done = step + 1
        if done % cfg.log_interval == 0 or done == cfg.max_steps:
            tokens_per_sec = window_tokens / max(window_seconds, 1e-9)
            history["step"].append(done)
            history["train_loss"].append(window_loss / window_steps)
            history["lr"].append(lr)
            history["grad_norm"].append(grad_norm)
            history["tokens_per_sec"].append(tokens_per_sec)
            history["elapsed_s"].append(time.perf_counter() - start)
            logger.info(
                "%s step %d/%d: loss %.4f, lr %.3g, grad norm %.3g, %.0f tokens/s",
                desc,
                done,
                cfg.max_steps,
                window_loss / window_steps,
                lr,
                grad_norm,
                tokens_per_sec,
            )
            window_loss, window_steps, window_tokens, window_seconds = 0.0, 0, 0, 0.0
        if done % cfg.eval_interval == 0 or done == cfg.max_steps:
            run_eval(done)

    model.eval()
    history["total_tokens"] = total_tokens
    history["train_seconds"] = train_seconds
    return history


def tokens_per_sec(history: Mapping[str, Any]) -> float:
    """Training throughput over the whole run (evaluation time excluded)."""
    return history["total_tokens"] / max(history["train_seconds"], 1e-9)


def curves_section(history: Mapping[str, Any], *, title: str = "Loss") -> list[tuple[str, str]]:
    """Report sections for a history: train/eval loss and the learning-rate schedule."""
    from lmforge.report_html import line_plot

    loss = line_plot(
        {
            "train": (history["step"], history["train_loss"]),
            "eval": (history["eval_step"], history["eval_loss"]),
        },
        title=title,
        xlabel="step",
        ylabel="loss (nats/token)",
    )
    lr = line_plot({"lr": (history["step"], history["lr"])}, title="Learning rate", xlabel="step", ylabel="lr")
    return [(title, loss), ("Learning rate", lr)]
