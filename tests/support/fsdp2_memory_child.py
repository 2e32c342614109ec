"""Measures what one rank of an FSDP2 job holds of the model state (not a test).

Usage: torchrun --nproc_per_node N fsdp2_memory_child.py MESHES_JSON OUT_DIR

For each ``name: mesh`` of MESHES_JSON, in one gloo process group: builds the tiny Llama of the FSDP2 tests, shards it
as the training loop does (``setup_backend``; a pipeline stage with ``pipeline_parallel`` in the mesh), takes one AdamW
step on random tokens, and writes ``OUT_DIR/<name>/rank<R>.json``:
the bytes of this rank's local shards of the weights, the gradients and the optimizer moments (what the plan's
``model_state_bytes`` estimates), the parameter count, and how many sequence positions the first block's second
norm sees on this rank (fewer than the sequence's with sequence parallelism).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lmforge.config import DistributedConfig, ModelConfig, TrainConfig
from lmforge.model.build import build_model
from lmforge.train.distributed import distributed_context
from lmforge.train.loop import setup_backend

MODEL = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=64)
VOCAB = 256


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _local_bytes(tensor: torch.Tensor) -> int:
    local = _local(tensor)
    return local.numel() * local.element_size()


def main() -> None:
    meshes, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")  # shared by the meshes: distributed_context joins it and leaves it alone
    for name, mesh in meshes.items():
        (out / name).mkdir(exist_ok=True)
        _measure(mesh, out / name)
        dist.barrier()
    dist.destroy_process_group()


def _measure(mesh: dict, out: Path) -> None:
    """Writes ``out/rank<R>.json`` for one mesh."""
    distributed = DistributedConfig.model_validate({"backend": "fsdp2", "mesh": mesh})
    micro_batches = mesh.get("pipeline_parallel", 1)
    cfg = TrainConfig(max_steps=1, batch_size=2, grad_accum=micro_batches, seq_len=16, precision="fp32",
                      distributed=distributed)  # fmt: skip
    with distributed_context(cfg.distributed) as ctx:
        model = build_model(MODEL, VOCAB, eos_id=0, pad_id=1, seed=0)
        parameters = sum(p.numel() for p in model.parameters())
        positions: list[int] = []  # what one rank's norm sees of the sequence
        norm = model.model.layers[0].post_attention_layernorm
        norm.register_forward_pre_hook(lambda _, args: positions.append(_local(args[0]).shape[1]))
        backend = setup_backend(model, cfg, ctx)
        ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
        if backend.pipeline is not None:  # forward and backward through the stages
            backend.pipeline.step([{"input_ids": ids, "targets": ids}] * micro_batches)
        else:
            backend.forward_model(input_ids=ids, labels=ids).loss.backward()
        backend.optimizer.step()
        params = [p for p in model.parameters() if p.requires_grad]
        state = [t for p in params for t in backend.optimizer.state[p].values() if t.dim() > 0]
        record = {
            "parameters": parameters,
            "weights": sum(_local_bytes(p) for p in params),
            "gradients": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(_local_bytes(t) for t in state),
            "norm_positions": positions[0] if positions else None,  # None: the block is on another stage
        }
        (out / f"rank{ctx.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
