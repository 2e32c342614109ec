"""The one training loop shared by ``pretrain``, ``finetune_lora`` and ``distill``.

A stage hands :func:`train` a model, a :class:`~lmforge.config.TrainConfig` and three callables:

* ``loss_fn(model, batch) -> (loss, n_tokens)``: the scalar loss of one micro-batch (mean over its
  scored tokens) and how many tokens it scored (an int, or a tensor that stays on the device);
* ``train_batch(step, micro) -> batch``: this rank's micro-batch ``micro`` of optimizer step ``step``,
  deterministic in (seed, step, micro, rank) so that a resumed run sees the same data;
* ``eval_batches() -> iterable of batches``: the fixed validation set.

The loop is AdamW with decoupled weight decay on matrices only, linear warmup then cosine decay,
gradient accumulation, global-norm clipping, autocast (``GradScaler`` only for fp16) and a guard that
skips steps with a non-finite loss or gradient. It runs as one process, as DistributedDataParallel
under ``torchrun``, on a DeepSpeed ZeRO engine, or sharded by FSDP2 on a data × tensor-parallel mesh
(:mod:`lmforge.train.fsdp2`); it writes and resumes checkpoints (model,
optimizer, step, scaler, RNG, data position, history) and stops cleanly on SIGTERM. :func:`train` runs a
:class:`TrainingRun`, whose :meth:`~TrainingRun.fit` holds the loop top to bottom and calls one method per
phase (one step, read back, log, evaluate, checkpoint, resume); the backends differ only in :class:`Backend`.

Speed without changing the math: AdamW's fused kernel (which also skips a non-finite step on the
device), no host sync between logging steps, the next micro-batches built in a background thread
(:class:`~lmforge.train.batches.Prefetcher`) and, with ``compile``, ``torch.compile`` with its first step
kept out of the throughput figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import random
import resource
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm.auto import tqdm

from lmforge.config import TrainConfig
from lmforge.errors import ConfigError, LmforgeError
from lmforge.train.batches import Prefetcher, map_tensors
from lmforge.train.distributed import DistContext
from lmforge.train.mfu import device_peak_flops, mfu
from lmforge.train.resume_state import (
    MODEL_STATE,
    OPTIMIZER_STATE,
    RNG_STATE,
    TRAINER_STATE,
    check_model_weights,
    check_optimizer_state,
    read_rng_states,
    read_trainer_state,
)

if TYPE_CHECKING:
    from lmforge.train.checkpoint import Checkpointer
    from lmforge.train.pipeline import Pipeline

logger = logging.getLogger("lmforge.train")

LossFn = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, int | torch.Tensor]]
OnStep = Callable[[int, dict[str, Any]], None]

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEEPSPEED_TAG = "deepspeed"


class TrainingPreempted(LmforgeError):
    """SIGTERM arrived; a final checkpoint was written (when configured) and training stopped."""


class NonFiniteLossError(LmforgeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


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


def _ndim(param: torch.Tensor) -> int:
    # ZeRO-3 replaces a partitioned parameter's data by an empty 1-D tensor; ds_shape keeps the real shape.
    return len(getattr(param, "ds_shape", param.shape))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on trainable ≥2-D weights, none on biases, norms and embeddings.

    Embedding tables are excluded because decay pulls rarely seen tokens' rows to zero; tied output
    heads share the embedding tensor and so are excluded with it (a pipeline's last stage, whose head is a
    copy of the tied embedding, excludes the copy).
    """
    from lmforge.train.pipeline import pipeline_of

    no_decay_ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) or "norm" in type(module).__name__.lower():
            no_decay_ids.update(id(p) for p in module.parameters(recurse=False))
    if (pipeline := pipeline_of(model)) is not None and pipeline.tied_copy:
        no_decay_ids.add(id(pipeline.tied))
    decay, no_decay = [], []
    for param in model.parameters():  # yields each shared (tied) tensor once
        if not param.requires_grad:
            continue
        if _ndim(param) >= 2 and id(param) not in no_decay_ids:
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
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batches: Iterable[Any],
    *,
    precision: str,
    device: torch.device | None = None,
) -> float:
    """Token-weighted mean of ``loss_fn`` over ``batches``, in eval mode (the mode is restored).

    Every rank evaluates every batch (ZeRO-3 needs all ranks in each forward), so all agree.
    """
    device = device or _model_device(model)
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


@contextlib.contextmanager
def sigterm_flag(enabled: bool) -> Iterator[threading.Event]:
    """An event set when SIGTERM arrives while inside the block (the previous handler is restored)."""
    event = threading.Event()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield event
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: event.set())
    try:
        yield event
    finally:
        signal.signal(signal.SIGTERM, previous)


def _rng_state(device: torch.device) -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state().tolist(),
        "cuda": torch.cuda.get_rng_state(device).tolist() if device.type == "cuda" else None,
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }


def _set_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8), device)
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def _memory_gb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocations on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def fused_adamw_supported(params: list[torch.Tensor], device: torch.device) -> bool:
    """Whether torch's fused AdamW kernel takes these parameters (floating point, all on a CPU or CUDA device)."""
    return device.type in ("cpu", "cuda") and all(p.is_floating_point() and p.device == device for p in params)


class _Accumulators:
    """A logging window's sums kept on the device, so that steps between two reads need no host sync.

    ``run`` counts the consecutive skipped steps up to the latest one and survives reads (it is the
    ``bad_in_row`` of a checkpoint); ``abort_at`` remembers the step at which it first reached the limit.
    """

    def __init__(self, device: torch.device, bad_in_row: int) -> None:
        def zero(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros((), dtype=dtype, device=device)

        self.loss, self.tokens, self.bad = zero(torch.float64), zero(torch.float64), zero(torch.float64)
        self.run = torch.full((), float(bad_in_row), dtype=torch.float64, device=device)
        self.abort_at, self.step_loss, self.grad_norm = zero(torch.float64), zero(torch.float64), zero(torch.float64)
        self.host_tokens = 0
        self.last_loss = self.last_grad_norm = math.nan

    def add(
        self,
        step_loss: torch.Tensor,
        tokens: int | torch.Tensor,
        bad: torch.Tensor,
        grad_norm: torch.Tensor,
        step: int,
        max_bad: int,
    ) -> None:
        """Account one optimizer step (``bad``: 1.0 when it was skipped)."""
        self.loss += step_loss
        if isinstance(tokens, torch.Tensor):
            self.tokens += tokens
        else:
            self.host_tokens += tokens
        self.bad += bad
        self.run.mul_(bad).add_(bad)  # (run + 1) if skipped else 0
        hit = (self.run >= max_bad) & (self.abort_at == 0)
        self.abort_at = torch.where(hit, float(step), self.abort_at)
        self.step_loss = step_loss.detach().double()
        self.grad_norm = grad_norm.detach().double()

    def read(self) -> tuple[float, int, int, int, int]:
        """``(loss sum, tokens, skipped steps, bad_in_row, abort step or 0)`` since the last read, in one transfer."""
        packed = torch.stack(
            [self.loss, self.tokens, self.bad, self.run, self.abort_at, self.step_loss, self.grad_norm]
        )
        loss, tokens, bad, run, abort_at, self.last_loss, self.last_grad_norm = packed.tolist()
        tokens = int(tokens) + self.host_tokens
        self.loss.zero_()
        self.tokens.zero_()
        self.bad.zero_()
        self.host_tokens = 0
        return loss, tokens, int(bad), int(run), int(abort_at)


@contextlib.contextmanager
def _prefetcher(
    train_batch: Callable[[int, int], Any], cfg: TrainConfig, start_step: int, device: torch.device
) -> Iterator[Prefetcher]:
    prefetcher = Prefetcher(
        train_batch,
        start_step=start_step,
        max_steps=cfg.max_steps,
        grad_accum=cfg.grad_accum,
        depth=cfg.prefetch_batches,
        pin=device.type == "cuda",
    )
    try:
        yield prefetcher
    finally:
        prefetcher.close()


def _tensorboard(log_dir: str | Path | None, ctx: DistContext) -> Any:
    if log_dir is None or not ctx.is_main:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        logger.info("tensorboard is not installed; no event files are written")
        return None
    return SummaryWriter(log_dir=str(log_dir))


# -- backend setup -------------------------------------------------------------------------------------


def _set_numerics(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> None:
    """TF32, deterministic kernels and activation checkpointing, as configured."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=device.type == "cuda")
    if cfg.grad_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        elif hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        else:
            raise ConfigError(f"grad_checkpointing: {type(model).__name__} does not support activation checkpointing")


@dataclasses.dataclass
class Backend:
    """How one optimizer step runs: one process, DistributedDataParallel, a DeepSpeed ZeRO engine or FSDP2.

    ``forward_model`` is what the loss is computed with (the wrapped, possibly compiled model);
    ``device_guard``: a non-finite step is skipped on the device by the fused kernel, with no host sync;
    ``fsdp_model``: the model FSDP2 sharded in place (:mod:`lmforge.train.fsdp2`), or None;
    ``pipeline``: its pipeline stage and schedule (:mod:`lmforge.train.pipeline`), or None.
    """

    forward_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    engine: Any  # a DeepSpeed engine, or None
    trainable: list[torch.Tensor]
    max_norm: float
    device_guard: bool
    ctx: DistContext
    precision: str
    fsdp_model: torch.nn.Module | None = None
    pipeline: Pipeline | None = None

    def accumulation(self, last: bool) -> contextlib.AbstractContextManager:
        """Where a micro-batch's backward runs: DDP all-reduces, FSDP2 reduce-scatters, only on the step's last."""
        if self.fsdp_model is not None:
            from lmforge.train.fsdp2 import micro_batch

            return micro_batch(self.fsdp_model, last)
        if last or self.engine is not None or not self.ctx.distributed:
            return contextlib.nullcontext()
        return self.forward_model.no_sync()

    def backward(self, loss: torch.Tensor, grad_accum: int) -> None:
        """Accumulate the gradient of one micro-batch's loss."""
        if self.engine is not None:
            self.engine.backward(loss)  # scales by 1/grad_accum itself
            self.engine.step()  # steps the optimizer only at the accumulation boundary
        else:
            self.scaler.scale(loss / grad_accum).backward()

    def clip(self) -> tuple[torch.Tensor, bool]:
        """The global gradient norm, clipped to ``max_norm``, and whether DeepSpeed skipped the step."""
        if self.engine is not None:
            return torch.tensor(float(self.engine.get_global_grad_norm() or 0.0)), not self.engine.was_step_applied()
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        if self.fsdp_model is not None:
            from lmforge.train.fsdp2 import clip_grad_norm_

            return clip_grad_norm_(self.trainable, self.max_norm, self.pipeline), False
        return torch.nn.utils.clip_grad_norm_(self.trainable, self.max_norm), False

    def step(self, step_loss: torch.Tensor, grad_norm: torch.Tensor, skipped: bool) -> torch.Tensor:
        """Apply the step unless the loss or gradient is non-finite on any rank; 1.0 (on the device) when skipped."""
        if self.device_guard:
            return self._step_guarded_on_device(step_loss, grad_norm)
        return self._step_guarded_on_host(step_loss, grad_norm, skipped)

    def _step_guarded_on_device(self, step_loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        bad = (~torch.isfinite(step_loss) | ~torch.isfinite(grad_norm)).to(torch.float32)
        self.optimizer.found_inf = self.ctx.all_max_(bad)  # the fused kernel leaves params and state alone
        self.optimizer.step()
        del self.optimizer.found_inf
        self.optimizer.zero_grad(set_to_none=True)
        return bad

    def _step_guarded_on_host(self, step_loss: torch.Tensor, grad_norm: torch.Tensor, skipped: bool) -> torch.Tensor:
        loss_value, norm_value = float(step_loss), float(grad_norm)
        # fp16: an inf gradient is the GradScaler's business (it skips and lowers the scale)
        grad_bad = not math.isfinite(norm_value) and self.precision != "fp16"
        (any_bad,) = self.ctx.any(not math.isfinite(loss_value) or grad_bad)
        if self.engine is None:
            if not any_bad:
                self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        return torch.tensor(float(any_bad or (skipped and self.precision != "fp16")), device=self.ctx.device)


def _deepspeed_engine(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainConfig, ctx: DistContext
) -> tuple[Any, torch.optim.Optimizer]:
    """The DeepSpeed engine, which owns accumulation, clipping, loss scaling and ZeRO sharding, and its optimizer."""
    import deepspeed

    from lmforge.train.deepspeed_config import deepspeed_json

    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_json(cfg, ctx.world_size))
    return engine, engine.optimizer


def setup_backend(model: torch.nn.Module, cfg: TrainConfig, ctx: DistContext) -> Backend:
    """Numerics switches, AdamW (fused where it can be) and the backend wrapping ``model``, as ``cfg`` says.

    FSDP2 shards ``model`` in place first, so that the optimizer holds the sharded parameters.
    """
    _set_numerics(model, cfg, ctx.device)
    fsdp_model, pipeline = _fsdp2_sharded(model, cfg, ctx)
    use_deepspeed = cfg.distributed.backend == "deepspeed"
    trainable = [p for p in model.parameters() if p.requires_grad]
    fused = cfg.fused_optimizer and not use_deepspeed and fused_adamw_supported(trainable, ctx.device)
    optimizer = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused or None
    )
    # Loss scaling only where fp16's narrow range needs it; bf16 and fp32 never underflow like that.
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.precision == "fp16" and not use_deepspeed)
    engine = None
    forward_model = model
    if use_deepspeed:
        engine, optimizer = _deepspeed_engine(model, optimizer, cfg, ctx)
        forward_model = engine
    elif ctx.distributed and fsdp_model is None:
        forward_model = torch.nn.parallel.DistributedDataParallel(
            model,
            device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            find_unused_parameters=cfg.distributed.find_unused_parameters,
        )
    if cfg.compile:
        forward_model = torch.compile(forward_model)
    return Backend(
        forward_model=forward_model,
        optimizer=optimizer,
        scaler=scaler,
        engine=engine,
        trainable=trainable,
        max_norm=cfg.grad_clip if cfg.grad_clip > 0 else math.inf,
        # With the fused optimizer a non-finite step is skipped on the device (its ``found_inf`` input), so the
        # loop reads losses, token counts and the skip counters back only at logging, evaluation and checkpoint
        # steps. Otherwise (fp16's GradScaler, DeepSpeed, the foreach kernels) the skip is decided on the host
        # and every step syncs, as it must.
        device_guard=fused and engine is None and cfg.precision != "fp16",
        ctx=ctx,
        precision=cfg.precision,
        fsdp_model=fsdp_model,
        pipeline=pipeline,
    )


def _fsdp2_sharded(
    model: torch.nn.Module, cfg: TrainConfig, ctx: DistContext
) -> tuple[torch.nn.Module | None, Pipeline | None]:
    """``model`` sharded in place by FSDP2 (with tensor parallelism and pipeline stages as the mesh says) and its
    pipeline; (None, None) for other backends."""
    if cfg.distributed.backend != "fsdp2":
        return None, None
    from lmforge.train.fsdp2 import shard_model

    return model, shard_model(model, cfg, ctx)


# -- training state -----------------------------------------------------------------------------------


def _new_history() -> dict[str, Any]:
    """An empty history (the keys :func:`train` returns)."""
    history: dict[str, Any] = {
        key: [] for key in ("step", "train_loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "memory_gb", "elapsed_s")
    }
    history |= {"eval_step": [], "eval_loss": [], "total_tokens": 0, "train_seconds": 0.0, "bad_steps": 0}
    history |= {"warmup_seconds": 0.0, "warmup_tokens": 0}
    history["resumed_from"] = None
    history["quarantined_checkpoints"] = []
    return history


def _new_window() -> dict[str, Any]:
    """An empty logging window: loss sum, steps, tokens and training seconds since the last log line."""
    return {"loss": 0.0, "steps": 0, "tokens": 0, "seconds": 0.0}


@dataclasses.dataclass
class TrainState:
    """What a checkpoint carries besides weights and optimizer state, and the step training starts from."""

    history: dict[str, Any] = dataclasses.field(default_factory=_new_history)
    window: dict[str, Any] = dataclasses.field(default_factory=_new_window)
    bad_in_row: int = 0
    start_step: int = 0


def _window_throughput(
    window: Mapping[str, Any], flops_per_token: float | None, peak_flops: float | None, world_size: int
) -> tuple[float, float | None]:
    """Tokens/s of a logging window and its MFU (None without a FLOPs figure or a known peak)."""
    tokens_per_sec = window["tokens"] / max(window["seconds"], 1e-9)
    if not (flops_per_token and peak_flops):
        return tokens_per_sec, None
    return tokens_per_sec, mfu(tokens_per_sec, flops_per_token, peak_flops, world_size)


def _is_due(done: int, interval: int, max_steps: int) -> bool:
    return done % interval == 0 or done == max_steps


# -- the run --------------------------------------------------------------------------------------------


class TrainingRun:
    """One call of :func:`train`: the backend, the state, and a method per phase of the loop in :meth:`fit`.

    Construction sets the backend up; :meth:`resume` loads the newest usable checkpoint; :meth:`fit` runs the
    loop. Each phase (:meth:`forward_backward`, :meth:`read_back`, :meth:`log`, :meth:`evaluate`,
    :meth:`save_checkpoint`) works on :attr:`state` and can be called on its own.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: TrainConfig,
        loss_fn: LossFn,
        train_batch: Callable[[int, int], Any],
        eval_batches: Callable[[], Iterable[Any]],
        *,
        eval_loss_fn: LossFn | None = None,
        desc: str = "train",
        dist: DistContext | None = None,
        flops_per_token: float | None = None,
        tensorboard_dir: str | Path | None = None,
        on_step: OnStep | None = None,
    ) -> None:
        if cfg.distributed.backend in ("deepspeed", "fsdp2") and dist is None:
            raise ConfigError(
                f"distributed.backend is {cfg.distributed.backend} but no process group was given (pass dist=...)"
            )
        self.model, self.cfg, self.desc, self.on_step = model, cfg, desc, on_step
        self.loss_fn, self.eval_loss_fn = loss_fn, eval_loss_fn or loss_fn
        self.train_batch, self.eval_batches = train_batch, eval_batches
        self.ctx = dist or DistContext(device=_model_device(model))
        self.backend = setup_backend(model, cfg, self.ctx)
        self.state = TrainState()
        self.flops_per_token = flops_per_token
        self.peak_flops = device_peak_flops(self.ctx.device, cfg.peak_flops)
        self.global_batch = cfg.batch_size * cfg.grad_accum * self.ctx.data_ranks
        self.checkpointer = self._checkpointer()
        self.tensorboard_dir, self.tb = tensorboard_dir, None
        self.acc = _Accumulators(self.ctx.device, self.state.bad_in_row)
        self.start = self.clock = time.perf_counter()  # reset by fit: run start (for elapsed_s), timed stretch start
        self.warmup_pending = cfg.compile  # the first step of a compiled model traces and compiles it

    # -- the loop -------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train from :attr:`state`'s start step to ``cfg.max_steps``; return the history (see :func:`train`)."""
        cfg = self.cfg
        stop_on_sigterm = self.checkpointer is not None and cfg.checkpoint.on_sigterm
        progress = self._begin()
        with (
            sigterm_flag(stop_on_sigterm) as sigterm,
            _prefetcher(self.train_batch, cfg, self.state.start_step, self.ctx.device) as batches,
        ):
            for step in progress:
                done = step + 1
                lr = self.set_lr(step)
                step_loss, step_tokens = self.forward_backward(step, batches)
                grad_norm, skipped = self.backend.clip()
                checkpoint, stop = self.checkpoint_or_stop(done, sigterm)
                bad = self.backend.step(step_loss, grad_norm, skipped)
                self.acc.add(step_loss, step_tokens, bad, grad_norm, done, cfg.max_bad_steps)
                self.state.window["steps"] += 1
                self.time_compilation(done)
                self.end_step(done, lr, checkpoint, stop)
        self._close_tensorboard()
        self.model.eval()
        return self.state.history

    def _begin(self) -> tqdm:
        """Open TensorBoard, evaluate a fresh run at step 0 and start the clocks; a progress bar over the steps."""
        self.tb = _tensorboard(self.tensorboard_dir, self.ctx)
        if self.state.start_step == 0:
            self.evaluate(0)
        self.model.train()
        self.start = time.perf_counter() - self.state.history["train_seconds"]
        steps = range(self.state.start_step, self.cfg.max_steps)
        progress = tqdm(steps, desc=self.desc, disable=None if self.ctx.is_main else True, dynamic_ncols=True)
        self.clock = time.perf_counter()
        return progress

    # -- one step -------------------------------------------------------------------------------------
    def set_lr(self, step: int) -> float:
        """Set and return the learning rate of optimizer step ``step``."""
        lr = lr_at(step, self.cfg)
        for group in self.backend.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def forward_backward(self, step: int, batches: Prefetcher) -> tuple[torch.Tensor, int | torch.Tensor]:
        """Forward and backward over the micro-batches of ``step``; its mean loss and scored tokens."""
        cfg, device = self.cfg, self.ctx.device
        if self.backend.pipeline is not None:  # the step's micro-batches flow through the stages together
            micro_batches = [to_device(batches.next(step, micro), device) for micro in range(cfg.grad_accum)]
            with autocast(cfg.precision, device):
                return self.backend.pipeline.step(micro_batches)
        step_loss = torch.zeros((), dtype=torch.float64, device=device)
        step_tokens: int | torch.Tensor = 0
        for micro in range(cfg.grad_accum):
            batch = to_device(batches.next(step, micro), device)
            with self.backend.accumulation(last=micro == cfg.grad_accum - 1):
                with autocast(cfg.precision, device):
                    loss, n_tokens = self.loss_fn(self.backend.forward_model, batch)
                self.backend.backward(loss, cfg.grad_accum)
                step_loss += loss.detach() / cfg.grad_accum
                step_tokens = step_tokens + n_tokens
        return step_loss, step_tokens

    def checkpoint_or_stop(self, done: int, sigterm: threading.Event) -> tuple[bool, ...]:
        """Whether a checkpoint is due after step ``done`` and whether SIGTERM arrived; every rank agrees."""
        if self.checkpointer is None:
            return False, sigterm.is_set()
        return self.ctx.any(self.checkpointer.due(done), sigterm.is_set())

    def time_compilation(self, done: int) -> None:
        """After a compiled model's first step: time it apart, so that it stays out of tokens/s."""
        if not self.warmup_pending:
            return
        self.warmup_pending = False
        self.read_back(done, warmup=True)
        if self.ctx.is_main:
            logger.info("%s: first step (compilation) took %.1f s; not counted in tokens/s", self.desc,
                        self.state.history["warmup_seconds"])  # fmt: skip

    def end_step(self, done: int, lr: float, checkpoint: bool, stop: bool) -> None:
        """Read back, log, evaluate, checkpoint and call ``on_step`` as due after step ``done``; stop on SIGTERM."""
        log_due = _is_due(done, self.cfg.log_interval, self.cfg.max_steps)
        eval_due = _is_due(done, self.cfg.eval_interval, self.cfg.max_steps)
        callback = self.on_step is not None
        record: dict[str, Any] = {"lr": lr}
        # with the device guard, steps between these need no host sync (see setup_backend)
        if log_due or eval_due or checkpoint or stop or not self.backend.device_guard or callback:
            record |= self.read_back(done)
        if log_due:
            self.log(done, lr, record)
        if eval_due:
            self.evaluate(done)
        if checkpoint or stop:
            self.save_checkpoint(done)
        if self.on_step is not None:
            self.on_step(done, record)
        if eval_due or checkpoint or stop or callback:
            self.clock = time.perf_counter()  # evaluation, checkpoints and callbacks are not training time
        if stop:
            self._stop(done)

    def _stop(self, done: int) -> None:
        assert self.checkpointer is not None  # SIGTERM is caught only when checkpoints are configured
        self._close_tensorboard()
        raise TrainingPreempted(
            f"{self.desc}: SIGTERM received; stopped after step {done} with a checkpoint in {self.checkpointer.root}"
        )

    # -- read back and log ----------------------------------------------------------------------------
    def read_back(self, done: int, *, warmup: bool = False) -> dict[str, float]:
        """Move the device accumulators into the window and history; the latest step's loss and grad norm.

        ``warmup``: the time and tokens since the last read were a compiled model's first step; they count
        in the totals and in ``warmup_seconds`` / ``warmup_tokens``, not in the window's tokens/s.

        Raises:
            NonFiniteLossError: ``cfg.max_bad_steps`` steps in a row were skipped.
        """
        loss_sum, tokens, bad, self.state.bad_in_row, abort_at = self.acc.read()  # waits for the device
        seconds = time.perf_counter() - self.clock
        tokens *= self.ctx.data_ranks  # tensor-parallel peers score the same tokens
        history, window = self.state.history, self.state.window
        window["loss"] += self.ctx.mean(loss_sum)
        if warmup:
            history["warmup_seconds"] += seconds
            history["warmup_tokens"] += tokens
        else:
            window["seconds"] += seconds
            window["tokens"] += tokens
        history["total_tokens"] += tokens
        history["train_seconds"] += seconds
        history["bad_steps"] += bad
        self._report_bad_steps(done, bad, abort_at)
        self.clock = time.perf_counter()
        return {"loss": self.acc.last_loss, "grad_norm": self.acc.last_grad_norm}

    def _report_bad_steps(self, done: int, bad: int, abort_at: int) -> None:
        cfg = self.cfg
        if bad and self.ctx.is_main:
            logger.warning(
                "%s: %d step(s) up to step %d had a non-finite loss or gradient norm and were skipped (%d in a row)",
                self.desc,
                bad,
                done,
                self.state.bad_in_row,
            )
        if abort_at:
            raise NonFiniteLossError(
                f"{self.desc}: {cfg.max_bad_steps} consecutive steps (up to step {abort_at}) had a non-finite loss "
                f"or gradient norm (last loss {self.acc.last_loss:.4g}, grad norm {self.acc.last_grad_norm:.4g}); "
                f"lower train.lr, check the data, or use bf16 instead of fp16 (train.max_bad_steps={cfg.max_bad_steps})"
            )

    def log(self, done: int, lr: float, record: dict[str, Any]) -> None:
        """Close the logging window after step ``done``: its figures go into ``record``, the history, the log and
        TensorBoard, and a new window opens. ``record`` holds the step's ``loss`` and ``grad_norm``."""
        window, history = self.state.window, self.state.history
        tokens_per_sec, utilization = _window_throughput(
            window, self.flops_per_token, self.peak_flops, self.ctx.world_size
        )
        record |= {
            "train_loss": window["loss"] / window["steps"],
            "tokens_per_sec": tokens_per_sec,
            "mfu": utilization,
            "memory_gb": _memory_gb(self.ctx.device),
        }
        history["step"].append(done)
        history["lr"].append(lr)
        for key in ("train_loss", "grad_norm", "tokens_per_sec", "mfu", "memory_gb"):
            history[key].append(record[key])
        history["elapsed_s"].append(time.perf_counter() - self.start)
        if self.ctx.is_main:
            logger.info(
                "%s step %d/%d: loss %.4f, lr %.3g, grad norm %.3g, %.0f tokens/s%s, %.2f GB",
                self.desc,
                done,
                self.cfg.max_steps,
                record["train_loss"],
                lr,
                record["grad_norm"],
                tokens_per_sec,
                f", MFU {100 * utilization:.1f}%" if utilization is not None else "",
                record["memory_gb"],
            )
        self._write_tensorboard(done, lr, record)
        self.state.window = _new_window()

    def _write_tensorboard(self, done: int, lr: float, record: Mapping[str, Any]) -> None:
        if self.tb is None:
            return
        for key in ("train_loss", "tokens_per_sec", "mfu", "memory_gb"):
            if record[key] is not None:
                self.tb.add_scalar(key.replace("train_loss", "loss/train"), record[key], done)
        self.tb.add_scalar("lr", lr, done)
        self.tb.add_scalar("grad_norm", record["grad_norm"], done)

    def _close_tensorboard(self) -> None:
        if self.tb is not None:
            self.tb.close()

    # -- evaluate -------------------------------------------------------------------------------------
    def evaluate(self, done: int) -> float:
        """Validation loss after step ``done``, recorded in the history, logged and written to TensorBoard."""
        pipeline = self.backend.pipeline
        loss_fn = pipeline.eval_loss if pipeline is not None else self.eval_loss_fn
        loss = evaluate(self.model, loss_fn, self.eval_batches(), precision=self.cfg.precision, device=self.ctx.device)
        self.state.history["eval_step"].append(done)
        self.state.history["eval_loss"].append(loss)
        if self.tb is not None:
            self.tb.add_scalar("loss/eval", loss, done)
        if self.ctx.is_main:
            logger.info("%s step %d: eval loss %.4f", self.desc, done, loss)
        return loss

    # -- checkpoint -----------------------------------------------------------------------------------
    def _checkpointer(self) -> Checkpointer | None:
        if self.cfg.checkpoint.dir is None:
            return None
        from lmforge.train.checkpoint import Checkpointer, resolve_checkpoint_config

        return Checkpointer(resolve_checkpoint_config(self.cfg.checkpoint, stage=self.desc), self.ctx)

    def save_checkpoint(self, done: int) -> None:
        """Checkpoint the state after step ``done`` (called on every rank; needs ``checkpoint.dir``)."""
        if self.checkpointer is None:
            raise ConfigError("checkpoint.dir is not set")
        rng_states = self.ctx.all_gather_object(_rng_state(self.ctx.device))
        self.checkpointer.save(
            done,
            lambda folder: self._write_checkpoint_files(folder, rng_states, done),
            extra={"backend": self.cfg.distributed.backend, "global_batch": self.global_batch},
        )

    def _write_checkpoint_files(self, folder: Path, rng_states: list[Any], step: int) -> None:
        backend = self.backend
        if backend.engine is not None:  # every rank writes its ZeRO shards
            backend.engine.save_checkpoint(str(folder), tag=DEEPSPEED_TAG, save_latest=False)
        elif backend.fsdp_model is not None:  # every rank writes its FSDP2 / tensor-parallel shards
            from lmforge.train import dcp

            dcp.save(self.model, backend.optimizer, folder)
        elif self.ctx.is_main:
            from safetensors.torch import save_model

            save_model(self.model, str(folder / MODEL_STATE))  # handles tied embeddings
            torch.save(backend.optimizer.state_dict(), folder / OPTIMIZER_STATE)
        if self.ctx.is_main:
            (folder / TRAINER_STATE).write_text(json.dumps(self._trainer_state(step)), encoding="utf-8")
            (folder / RNG_STATE).write_text(json.dumps(rng_states), encoding="utf-8")

    def _trainer_state(self, step: int) -> dict[str, Any]:
        """What ``trainer_state.json`` holds (read back by :func:`~lmforge.train.resume_state.read_trainer_state`)."""
        scaler = self.backend.scaler
        return {
            "step": step,
            "data_position": {"step": step, "sequences_seen": step * self.global_batch},
            "global_batch": self.global_batch,
            "seed": self.cfg.seed,
            "scaler": scaler.state_dict() if scaler.is_enabled() else None,
            "bad_in_row": self.state.bad_in_row,
            "window": self.state.window,
            "history": self.state.history,
        }

    # -- resume ---------------------------------------------------------------------------------------
    def resume(self) -> None:
        """Continue from the newest checkpoint that holds what resume reads, when ``checkpoint.dir`` has one.

        Newer checkpoints that do not verify are moved to quarantine and listed in the history by URI.
        """
        checkpointer = self.checkpointer
        if checkpointer is None or checkpointer.resume_step() is None:
            return
        with tempfile.TemporaryDirectory(prefix="lmforge-resume-") as scratch:
            found = checkpointer.fetch_newest_valid(scratch, self._check_resumable)
            if found is not None:
                self._load_checkpoint(*found)
        # every checkpoint moved aside, by URI: training_history.json, the stage's summary and report
        history = self.state.history
        history["quarantined_checkpoints"] = [*history.get("quarantined_checkpoints", []), *checkpointer.quarantined]

    def _check_resumable(self, step: int, folder: Path) -> None:
        read_trainer_state(folder, step)
        read_rng_states(folder)
        if self.backend.fsdp_model is not None:
            from lmforge.train import dcp

            dcp.check(folder, self.model)
        elif self.backend.engine is None:  # DeepSpeed checks its own shards when it loads them
            check_model_weights(folder / MODEL_STATE, self.model)
            check_optimizer_state(folder / OPTIMIZER_STATE, self.backend.optimizer)

    def _load_checkpoint(self, step: int, folder: Path) -> None:
        assert self.checkpointer is not None
        saved = read_trainer_state(folder, step)
        if saved["global_batch"] != self.global_batch or saved["seed"] != self.cfg.seed:
            raise ConfigError(
                f"checkpoint {self.checkpointer.uri(step)} was made with global batch "
                f"{saved['global_batch']} and seed {saved['seed']}; this run has {self.global_batch} and "
                f"{self.cfg.seed}, so it would see other data"
            )
        self._load_weights(folder)
        if saved["scaler"] is not None:
            self.backend.scaler.load_state_dict(saved["scaler"])
        rng_states = read_rng_states(folder)
        _set_rng_state(rng_states[self.ctx.rank % len(rng_states)], self.ctx.device)
        history = saved["history"]
        history.setdefault("warmup_seconds", 0.0)  # checkpoints written before these were recorded
        history.setdefault("warmup_tokens", 0)
        history["resumed_from"] = saved["step"]
        self.state = TrainState(history, saved["window"], saved["bad_in_row"], saved["step"])
        self.acc = _Accumulators(self.ctx.device, self.state.bad_in_row)
        if self.ctx.is_main:
            logger.info("%s: resumed from checkpoint %s", self.desc, self.checkpointer.uri(step))

    def _load_weights(self, folder: Path) -> None:
        from lmforge.train.checkpoint import load_tensor_file, tensor_only_deepspeed_loading

        engine = self.backend.engine
        if engine is not None:
            with tensor_only_deepspeed_loading(engine):
                engine.load_checkpoint(str(folder), tag=DEEPSPEED_TAG, load_lr_scheduler_states=False)
            return
        if self.backend.fsdp_model is not None:  # at any mesh: DCP reads the pieces this rank's shards need
            from lmforge.train import dcp

            dcp.load(self.model, self.backend.optimizer, folder)
            return
        from safetensors.torch import load_model

        load_model(self.model, str(folder / MODEL_STATE), device=str(self.ctx.device))
        self.backend.optimizer.load_state_dict(load_tensor_file(folder / OPTIMIZER_STATE))


def train(
    model: torch.nn.Module,
    cfg: TrainConfig,
    loss_fn: LossFn,
    train_batch: Callable[[int, int], Any],
    eval_batches: Callable[[], Iterable[Any]],
    *,
    eval_loss_fn: LossFn | None = None,
    desc: str = "train",
    dist: DistContext | None = None,
    flops_per_token: float | None = None,
    tensorboard_dir: str | Path | None = None,
    on_step: OnStep | None = None,
) -> dict[str, Any]:
    """Optimize ``model`` in place for ``cfg.max_steps`` steps; return the history.

    Args:
        model: parameters with ``requires_grad`` are trained, on the device the model is on.
        cfg: optimizer, schedule, precision, checkpoint and backend settings.
        loss_fn: ``(model, batch) -> (mean loss, scored tokens)`` for training micro-batches.
        train_batch: ``(step, micro) -> batch`` of this rank; tensors are moved to the device here.
        eval_batches: returns the validation batches; evaluated before training (``eval_step`` 0),
            every ``cfg.eval_interval`` steps and after the last step.
        eval_loss_fn: loss for validation when it differs from the training loss (default ``loss_fn``).
        desc: progress-bar label; the stage name, which fills ``{stage}`` in a templated ``checkpoint.dir``.
        dist: the process group (:func:`~lmforge.train.distributed.distributed_context`); None is one process.
        flops_per_token: training FLOPs per token (:mod:`lmforge.train.mfu`) for the MFU figure.
        tensorboard_dir: where rank 0 writes TensorBoard event files (when tensorboard is installed).
        on_step: called as ``on_step(step, record)`` after each completed optimizer step (and checkpoint);
            ``record`` holds ``lr``, ``loss`` and ``grad_norm``, and the interval's figures on logging steps.
            Passing it makes every step read its loss back from the device.

    Returns:
        ``step``, ``train_loss``, ``lr``, ``grad_norm``, ``tokens_per_sec``, ``mfu``, ``memory_gb``,
        ``elapsed_s`` (one entry per ``cfg.log_interval`` steps, losses averaged over the interval);
        ``eval_step``, ``eval_loss``; ``total_tokens``, ``train_seconds`` (without evaluation),
        ``warmup_seconds`` and ``warmup_tokens`` (a compiled model's first step, part of the totals but not
        of ``tokens_per_sec``), ``bad_steps`` (skipped non-finite steps) and ``resumed_from`` (a step, or None).

    Raises:
        TrainingPreempted: SIGTERM arrived; a final checkpoint was written first when configured.
        NonFiniteLossError: ``cfg.max_bad_steps`` consecutive steps had a non-finite loss or gradient.
    """
    run = TrainingRun(
        model, cfg, loss_fn, train_batch, eval_batches, eval_loss_fn=eval_loss_fn, desc=desc, dist=dist,
        flops_per_token=flops_per_token, tensorboard_dir=tensorboard_dir, on_step=on_step,
    )  # fmt: skip
    run.resume()
    return run.fit()


def _partitioned(model: torch.nn.Module) -> bool:
    """Whether no rank holds all of ``model``'s weights: ZeRO-3 partitions or FSDP2 / tensor-parallel shards."""
    from lmforge.train.fsdp2 import is_sharded

    return is_sharded(model) or any(hasattr(p, "ds_id") for p in model.parameters())


def full_state_dict(model: torch.nn.Module, ctx: DistContext) -> dict[str, torch.Tensor] | None:
    """The complete weights on rank 0 (None elsewhere), gathering ZeRO-3 partitions one tensor at a time and
    FSDP2 / tensor-parallel shards into CPU memory.

    Called on every rank; for a model that is not partitioned it is just ``model.state_dict()``.
    """
    if not _partitioned(model):
        return model.state_dict() if ctx.is_main else None
    from lmforge.train import fsdp2

    if fsdp2.is_sharded(model):
        return fsdp2.full_state_dict(model, ctx)
    import deepspeed

    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            if ctx.is_main:
                state[name] = param.detach().cpu().clone()
    if not ctx.is_main:
        return None
    for name, buffer in model.named_buffers():
        if name in model.state_dict():
            state[name] = buffer.detach().cpu().clone()
    return state


def whole_model(
    model: torch.nn.Module, ctx: DistContext, build: Callable[[], torch.nn.Module]
) -> torch.nn.Module | None:
    """``model`` with all of its weights on rank 0 (None on the other ranks); called on every rank.

    A ZeRO-3 or FSDP2 model's shards are gathered (:func:`full_state_dict`) into a plain copy made by ``build``
    (an unpartitioned model of the same architecture), which saves as a normal Hugging Face model; any
    other model is returned as it is.
    """
    if not _partitioned(model):
        return model if ctx.is_main else None
    state = full_state_dict(model, ctx)
    if state is None:
        return None
    copy = build()
    missing, unexpected = copy.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if copy.config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"consolidated sharded weights do not fit: missing {missing}, unexpected {unexpected}")
    copy.tie_weights()
    return copy


def tokens_per_sec(history: Mapping[str, Any]) -> float:
    """Training throughput over the whole run: evaluation and a compiled model's first step excluded."""
    tokens = history["total_tokens"] - history.get("warmup_tokens", 0)
    return tokens / max(history["train_seconds"] - history.get("warmup_seconds", 0.0), 1e-9)


def scale_metrics(history: Mapping[str, Any] | None, world_size: int) -> dict[str, float]:
    """A training stage's size and efficiency as metrics: ``world_size`` and, where the device's peak is known, the
    last logged ``mfu`` (what the plan's measured MFU and the report's plan against actual read)."""
    metrics = {"world_size": float(world_size)}
    if history is not None and history["mfu"] and history["mfu"][-1] is not None:
        metrics["mfu"] = history["mfu"][-1]
    return metrics


def quarantine_facts(history: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    """Metrics and summary entries for the checkpoints resume moved to quarantine (both empty when none)."""
    moved = history.get("quarantined_checkpoints") or []
    if not moved:
        return {}, {}
    return {"quarantined_checkpoints": float(len(moved))}, {"quarantined_checkpoints": [m["uri"] for m in moved]}


def curves_section(history: Mapping[str, Any], *, title: str = "Loss") -> list[tuple[str, str]]:
    """Report sections for a history: train/eval loss, the learning-rate schedule, quarantined checkpoints."""
    from lmforge.report_html import line_plot, table

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
    sections = [(title, loss), ("Learning rate", lr)]
    if moved := history.get("quarantined_checkpoints"):
        rows = [[m["uri"], m["moved_to"], m["reason"]] for m in moved]
        sections.append(("Quarantined checkpoints", table(["checkpoint", "moved to", "why"], rows)))
    return sections
