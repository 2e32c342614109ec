"""The DeepSpeed JSON, generated from validated settings instead of written by hand.

:class:`DeepSpeedJSON` mirrors the part of DeepSpeed's config schema lmforge uses. It is strict, so a
value DeepSpeed would silently coerce (``"reduce_bucket_size": true`` becoming 1) is an error here,
and it checks what DeepSpeed checks late or not at all (fp16 and bf16 together, the batch identity
``train_batch_size = micro × accumulation × world size``). Nothing here imports ``deepspeed``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field, model_validator

from lmforge.config import DeepSpeedFp16Config, StrictModel, TrainConfig

_COMM_DTYPES = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


class OffloadJSON(StrictModel):
    """``offload_optimizer`` / ``offload_param``."""

    device: Literal["cpu", "nvme"] = Field(description="Where the offloaded tensors live.")
    pin_memory: bool = Field(True, description="Pin the host buffers.")


class ZeroJSON(StrictModel):
    """``zero_optimization``."""

    stage: int = Field(ge=0, le=3, description="ZeRO stage.")
    overlap_comm: bool = Field(description="Overlap reduction with backward.")
    contiguous_gradients: bool = Field(description="Contiguous gradient buffer.")
    reduce_scatter: bool = Field(description="Reduce-scatter instead of all-reduce.")
    reduce_bucket_size: int = Field(gt=0, description="Elements per reduction bucket.")
    allgather_bucket_size: int | None = Field(None, gt=0, description="Elements per all-gather (stage 1/2).")
    stage3_prefetch_bucket_size: int | None = Field(None, ge=0, description="Stage 3 prefetch elements.")
    stage3_param_persistence_threshold: int | None = Field(None, ge=0, description="Stage 3 persistence threshold.")
    stage3_max_live_parameters: int | None = Field(None, gt=0, description="Stage 3 live parameter budget.")
    stage3_max_reuse_distance: int | None = Field(None, ge=0, description="Stage 3 reuse distance.")
    stage3_gather_16bit_weights_on_model_save: bool | None = Field(
        None, description="Stage 3: gather full weights when saving the model."
    )
    offload_optimizer: OffloadJSON | None = Field(None, description="Optimizer state offload.")
    offload_param: OffloadJSON | None = Field(None, description="Parameter offload (stage 3).")

    @model_validator(mode="after")
    def _stage3_keys(self) -> ZeroJSON:
        stage3 = [f for f in self.model_fields_set if f.startswith("stage3_") or f == "offload_param"]
        if self.stage != 3 and any(getattr(self, f) is not None for f in stage3):
            raise ValueError(f"{', '.join(sorted(stage3))} need stage 3 (stage is {self.stage})")
        return self


class EnabledJSON(StrictModel):
    """``bf16``."""

    enabled: bool = Field(description="Train in this precision.")


class Fp16JSON(StrictModel):
    """``fp16`` with dynamic loss scaling (``loss_scale`` 0)."""

    enabled: bool = Field(description="Train in fp16.")
    loss_scale: float = Field(0.0, ge=0.0, description="0: dynamic loss scaling; > 0: a fixed scale.")
    initial_scale_power: int = Field(16, ge=0, le=32, description="Initial dynamic scale 2**power.")
    loss_scale_window: int = Field(1000, gt=0, description="Steps between scale increases.")
    hysteresis: int = Field(2, gt=0, description="Overflows before the scale shrinks.")
    min_loss_scale: float = Field(1.0, gt=0.0, description="Smallest dynamic scale.")


class DeepSpeedJSON(StrictModel):
    """The DeepSpeed config handed to ``deepspeed.initialize`` (``model_dump(exclude_none=True)``)."""

    train_batch_size: int = Field(gt=0, description="Global batch: micro × accumulation × world size.")
    train_micro_batch_size_per_gpu: int = Field(gt=0, description="Sequences per micro-batch per rank.")
    gradient_accumulation_steps: int = Field(gt=0, description="Micro-batches per optimizer step.")
    gradient_clipping: float = Field(ge=0.0, description="Global gradient-norm clip (0 disables).")
    steps_per_print: int = Field(gt=0, description="DeepSpeed's own logging interval.")
    wall_clock_breakdown: bool = Field(False, description="DeepSpeed timers.")
    bf16: EnabledJSON | None = Field(None, description="bf16 training.")
    fp16: Fp16JSON | None = Field(None, description="fp16 training with loss scaling.")
    communication_data_type: Literal["fp32", "bf16", "fp16"] | None = Field(None, description="Gradient comm dtype.")
    zero_optimization: ZeroJSON = Field(description="ZeRO settings.")
    zero_allow_untested_optimizer: bool = Field(True, description="Allow the client torch AdamW.")
    zero_force_ds_cpu_optimizer: bool = Field(False, description="Do not demand DeepSpeedCPUAdam when offloading.")

    @model_validator(mode="after")
    def _consistent(self) -> DeepSpeedJSON:
        if self.bf16 is not None and self.fp16 is not None and self.bf16.enabled and self.fp16.enabled:
            raise ValueError("bf16 and fp16 are both enabled; choose one precision")
        per_rank = self.train_micro_batch_size_per_gpu * self.gradient_accumulation_steps
        if self.train_batch_size % per_rank:
            raise ValueError(
                f"train_batch_size ({self.train_batch_size}) is not a multiple of micro batch × accumulation "
                f"({per_rank})"
            )
        return self


def deepspeed_json(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config dict for ``cfg`` on ``world_size`` ranks, validated by :class:`DeepSpeedJSON`."""
    ds = cfg.distributed.deepspeed
    zero = ds.zero
    zero_section: dict[str, Any] = {
        "stage": zero.stage,
        "overlap_comm": zero.overlap_comm,
        "contiguous_gradients": zero.contiguous_gradients,
        "reduce_scatter": zero.reduce_scatter,
        "reduce_bucket_size": zero.reduce_bucket_size,
    }
    if zero.stage == 3:
        zero_section |= {
            "stage3_prefetch_bucket_size": zero.stage3_prefetch_bucket_size,
            "stage3_param_persistence_threshold": zero.stage3_param_persistence_threshold,
            "stage3_max_live_parameters": zero.stage3_max_live_parameters,
            "stage3_max_reuse_distance": zero.stage3_max_reuse_distance,
            "stage3_gather_16bit_weights_on_model_save": True,
        }
        if zero.offload_param != "none":
            zero_section["offload_param"] = {"device": zero.offload_param}
    else:
        zero_section["allgather_bucket_size"] = zero.allgather_bucket_size
    if zero.offload_optimizer != "none":
        zero_section["offload_optimizer"] = {"device": zero.offload_optimizer}
    config: dict[str, Any] = {
        "train_batch_size": cfg.batch_size * cfg.grad_accum * world_size,
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.grad_clip,
        "steps_per_print": 1_000_000_000,  # lmforge logs; keep DeepSpeed quiet
        "zero_optimization": zero_section,
    }
    if cfg.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif cfg.precision == "fp16":
        scaling = (ds.fp16 or DeepSpeedFp16Config()).model_dump()
        config["fp16"] = {"enabled": True, "loss_scale": 0.0, **scaling}
    if ds.communication_data_type is not None:
        config["communication_data_type"] = _COMM_DTYPES[ds.communication_data_type]
    return DeepSpeedJSON.model_validate(config).model_dump(mode="json", exclude_none=True)


@contextlib.contextmanager
def hf_zero3_init(cfg: TrainConfig, world_size: int) -> Iterator[None]:
    """While open, ``transformers`` builds models under ``deepspeed.zero.Init`` (ZeRO stage 3 only).

    ``HfDeepSpeedConfig`` makes ``from_config`` partition each parameter as it is created *and* run the
    Hugging Face initializers on the gathered tensors, so the initial loss is about ln(vocab) (a bare
    ``zero.Init`` leaves the initializers acting on empty partitions);
    :func:`~lmforge.model.build.build_model` then redraws them module by module so that the values equal
    those of a model built whole in one process. A no-op for other backends and stages, or with
    ``distributed.deepspeed.zero3_init: false`` (DeepSpeed then partitions a model built whole on every rank).
    """
    ds = cfg.distributed.deepspeed
    if cfg.distributed.backend != "deepspeed" or ds.zero.stage != 3 or not ds.zero3_init:
        yield
        return
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    keep_alive = HfDeepSpeedConfig(deepspeed_json(cfg, world_size))  # transformers holds only a weak reference
    try:
        yield
    finally:
        del keep_alive
        unset_hf_deepspeed_config()
