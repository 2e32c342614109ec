"""A frozen model sharded by FSDP2 over every rank of the process group: each rank keeps 1/world of its weights.

The distillation teacher (``distill.teacher_sharding: fsdp2``) uses it when it does not fit one GPU. Each transformer
block, then the root (embeddings, final norm, head), is ``fully_shard``-ed on a one-dimensional mesh of all ranks
with ``reshard_after_forward=True``, so a forward pass gathers the root's weights and one block's at a time and frees
them again when it leaves them. Every rank runs the model on its own batch; the all-gathers are collectives, so every
rank must call the model the same number of times in the same order. The model is never trained: no optimizer, no
gradients, eval mode.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lmforge.train.fsdp2 import transformer_blocks

MESH_DIM = "frozen_shard"


def shard_frozen(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Freeze ``model`` (no grad, eval mode, ``dtype``) and shard it in place over every rank; return the rank count.

    ``model`` may still be on the host: ``fully_shard`` moves each block to ``device`` as it shards it, so the device
    never holds more than one block of the whole model besides the shards. Needs an initialized process group.
    """
    model.requires_grad_(False)
    model.to(dtype=dtype).eval()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=(MESH_DIM,))
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    # explicit True: FSDP2 would otherwise keep the root's weights gathered after the forward, for a backward
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return mesh.size()


def local_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s weights this rank holds: a sharded parameter's local shard, any other parameter whole."""
    total = 0
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        total += local.numel() * local.element_size()
    return total
