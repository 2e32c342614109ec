"""FSDP2 on a device mesh: tensor parallelism, per-block sharding, accumulation and clipping across meshes.

The mesh is ``(pp, dp_shard, tp)``, row-major, so the ``tp`` ranks of one data-parallel group are adjacent and
each pipeline stage is a block of consecutive ranks (:class:`~lmforge.train.distributed.DistContext` reads the
batch index from the same layout). The model is split as torchtitan's Llama recipe does: first tensor parallelism
on the ``tp`` dimension (:func:`apply_tensor_parallel`), then the pipeline stage cut out
(:mod:`lmforge.train.pipeline`), then ``fully_shard`` on the ``dp_shard`` dimension, each transformer block first
and the root last, so that one block's parameters are gathered at a time. Parameters stay fp32 masters;
``MixedPrecisionPolicy`` casts them to bf16 for compute with ``train.precision: bf16`` and reduces gradients in
fp32, and fp32 runs without a cast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from peft import PeftModel
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lmforge.config import TrainConfig
from lmforge.errors import ConfigError
from lmforge.train.distributed import DistContext
from lmforge.train.tensor_parallel import apply_tensor_parallel, check_tensor_parallel, hf_order

if TYPE_CHECKING:
    from lmforge.train.pipeline import Pipeline

MESH_DIMS = ("pp", "dp_shard", "tp")


def device_mesh(ctx: DistContext) -> DeviceMesh:
    """The ``(pp, dp_shard, tp)`` mesh over every rank of the process group."""
    shape = (ctx.pipeline_parallel, ctx.data_ranks, ctx.tensor_parallel)
    return init_device_mesh(ctx.device.type, shape, mesh_dim_names=MESH_DIMS)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks: ``model.layers`` of a Llama, ``transformer.h`` of a GPT-2 (of the base model
    under a PEFT adapter; a pipeline stage's own blocks)."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    for path in ("model.layers", "transformer.h"):
        try:
            blocks = base.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(blocks, torch.nn.ModuleList):
            return list(blocks)
        if isinstance(blocks, torch.nn.ModuleDict):  # a pipeline stage's blocks, by their index in the model
            return list(blocks.values())
    raise ConfigError(f"distributed.backend fsdp2: {type(model).__name__} has no model.layers or transformer.h blocks")


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction for ``bf16``; no cast at all for ``fp32``."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(model: torch.nn.Module, cfg: TrainConfig, ctx: DistContext) -> Pipeline | None:
    """Apply tensor parallelism (when the mesh has it), cut out this rank's pipeline stage (when it has stages),
    then ``fully_shard`` every block and the root, in place; the stage's schedule, or None without stages."""
    mesh = device_mesh(ctx)
    if ctx.tensor_parallel > 1:
        check_tensor_parallel(model, ctx.tensor_parallel)
        apply_tensor_parallel(model, mesh["tp"])
    policy = mixed_precision(cfg.precision)

    def shard(module: torch.nn.Module) -> None:
        for block in transformer_blocks(module):
            fully_shard(block, mesh=mesh["dp_shard"], mp_policy=policy)
        fully_shard(module, mesh=mesh["dp_shard"], mp_policy=policy)

    if ctx.pipeline_parallel == 1:
        shard(model)
        return None
    from lmforge.train.pipeline import build_pipeline

    schedule = cfg.distributed.mesh.pipeline_schedule
    return build_pipeline(model, mesh, ctx, schedule, cfg.grad_accum, shard)


@contextlib.contextmanager
def micro_batch(model: torch.nn.Module, last: bool) -> Iterator[None]:
    """Inside the block, a backward pass reduce-scatters gradients and frees the gathered parameters only on the
    step's ``last`` micro-batch; before it, gradients accumulate unsharded and parameters stay gathered."""
    assert isinstance(model, FSDPModule)
    model.set_requires_gradient_sync(last)
    model.set_reshard_after_backward(last)
    yield


@torch.no_grad()
def clip_grad_norm_(params: list[torch.Tensor], max_norm: float, pipeline: Pipeline | None = None) -> torch.Tensor:
    """Clip the gradients to a global norm of ``max_norm``; return the norm before clipping.

    The norm is over the whole mesh: the sharded gradients of a tensor-parallel model live on two meshes (the 2-D
    mesh for the split matrices, the data-parallel one for norms), which ``torch.nn.utils.clip_grad_norm_`` cannot
    stack, so each mesh's norm is reduced on its own and the norms are combined; with a ``pipeline``, so are the
    stages' norms (a tied embedding counted once).
    """
    counted = pipeline.norm_parameters(params) if pipeline is not None else params
    norms = [_norm_over_mesh(group) for group in _by_mesh(counted).values()]
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    if pipeline is not None:
        total = pipeline.norm_over_stages(total)
    for group in _by_mesh(params).values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _by_mesh(params: list[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    """The parameters that have a gradient, by the mesh their gradient lives on (None: a plain tensor)."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            key = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            groups.setdefault(key, []).append(param)
    return groups


def _norm_over_mesh(params: list[torch.Tensor]) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def full_state_dict(model: torch.nn.Module, ctx: DistContext) -> dict[str, torch.Tensor] | None:
    """The complete, unsharded weights on rank 0 in CPU memory (None elsewhere); called on every rank. A pipeline
    stage's weights are gathered on the stage's first rank and sent to rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lmforge.train.pipeline import pipeline_of

    if (pipeline := pipeline_of(model)) is not None:
        state = pipeline.gather_weights()
    else:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return hf_order(model, state) if ctx.is_main and state is not None else None


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` was split by :func:`shard_model` (its parameters are DTensors)."""
    return isinstance(model, FSDPModule)
