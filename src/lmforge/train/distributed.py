"""Process-group setup and the few collectives the training loop needs.

``torchrun`` (or the Kubeflow Trainer) starts one process per device and sets ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. :func:`distributed_context` turns those into a
:class:`DistContext`; without them it is a single process and every collective is the identity.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lmforge.artifacts import staged_output
from lmforge.config import DistributedConfig
from lmforge.errors import ConfigError, InputDataError

logger = logging.getLogger("lmforge.train")


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job: its rank, the world size, its device, the tensor-parallel degree and
    the pipeline stages.

    With ``tensor_parallel`` > 1 (fsdp2), the adjacent ranks of one tensor-parallel group read the same batch, and
    with ``pipeline_parallel`` > 1 so do the ranks at the same place of every stage: the data is split over
    :attr:`data_ranks` groups, of which this rank is in :attr:`data_rank`.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0 writes outputs, logs and manifests."""
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """Which part of each step's global batch this rank reads."""
        return (self.rank // self.tensor_parallel) % self.data_ranks

    @property
    def data_ranks(self) -> int:
        """How many parts each step's global batch is split into (the data-parallel degree)."""
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel)

    @property
    def pipeline_stage(self) -> int:
        """Which pipeline stage this rank runs (0 without pipeline parallelism)."""
        return self.rank // (self.world_size // self.pipeline_parallel)

    @property
    def distributed(self) -> bool:
        """True when a process group with more than one rank is running."""
        return self.world_size > 1

    def mean(self, value: float) -> float:
        """Mean of ``value`` over ranks (float64 so that averaging adds no rounding of its own)."""
        if not self.distributed:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(tensor)
        return float(tensor.item()) / self.world_size

    def any(self, *flags: bool) -> tuple[bool, ...]:
        """Element-wise OR of boolean flags over ranks (one collective for all of them)."""
        if not self.distributed:
            return tuple(flags)
        tensor = torch.tensor([float(f) for f in flags], device=self._comm_device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tuple(bool(v) for v in tensor.tolist())

    def all_max_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise max over ranks, in place and returned (a device collective: no host sync on NCCL)."""
        if self.distributed:
            comm = tensor.to(self._comm_device)
            dist.all_reduce(comm, op=dist.ReduceOp.MAX)
            tensor.copy_(comm)
        return tensor

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.distributed:
            dist.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable, small), in rank order."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    @property
    def _comm_device(self) -> torch.device:
        # NCCL only moves CUDA tensors; gloo only CPU ones.
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


@contextlib.contextmanager
def distributed_context(cfg: DistributedConfig) -> Iterator[DistContext]:
    """Join the process group the launcher describes (if any); leave it again on exit if we created it.

    DeepSpeed and FSDP2 always need a process group, so with ``backend: deepspeed`` or ``fsdp2`` a lone
    process (no launcher variables) gets a one-rank group of its own.

    Raises:
        ConfigError: with ``backend: fsdp2``, the mesh's degrees do not multiply to the world size.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    tensor_parallel = _mesh_degrees(cfg, world_size)[1]
    pipeline_parallel = cfg.mesh.pipeline_parallel if cfg.backend == "fsdp2" else 1
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    needs_group = world_size > 1 or cfg.backend in ("deepspeed", "fsdp2")
    created = False
    if needs_group and not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # a lone process: a private one-rank group
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
        backend = cfg.process_group
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(minutes=cfg.timeout_minutes)
        if cfg.backend == "deepspeed":
            os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
            import deepspeed

            deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, timeout=timeout, rank=rank, world_size=world_size)
        created = True
        logger.info("joined %s process group: rank %d of %d on %s", backend, rank, world_size, device)
    ctx = DistContext(
        rank=rank, local_rank=local_rank, world_size=world_size, device=device, tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
    )  # fmt: skip
    try:
        yield ctx
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _mesh_degrees(cfg: DistributedConfig, world_size: int) -> tuple[int, int]:
    """``(data_parallel_shard, tensor_parallel)``: the fsdp2 mesh, else every rank data-parallel."""
    if cfg.backend != "fsdp2":
        return world_size, 1
    try:
        return cfg.mesh.degrees(world_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def describe_backend(cfg: DistributedConfig) -> str:
    """``torch``, ``deepspeed ZeRO-<stage>`` or ``fsdp2 tensor_parallel <tp>[ pipeline_parallel <pp>]``, for log
    lines."""
    if cfg.backend == "deepspeed":
        return f"deepspeed ZeRO-{cfg.deepspeed.zero.stage}"
    if cfg.backend == "fsdp2":
        stages = cfg.mesh.pipeline_parallel
        return f"fsdp2 tensor_parallel {cfg.mesh.tensor_parallel}" + (f" pipeline_parallel {stages}" * (stages > 1))
    return cfg.backend


def refuse_occupied(*output_dirs: str | Path) -> None:
    """Raise unless every output directory is absent or empty.

    Stages call it on every rank before training (rank 0's ``staged_output`` checks again when it opens
    the outputs), so that no rank starts training alone and the others fail only after it.

    Raises:
        InputDataError: an output exists and is a file or a non-empty directory.
    """
    for output_dir in map(Path, output_dirs):
        if output_dir.exists() and (output_dir.is_file() or any(output_dir.iterdir())):
            raise InputDataError(f"output {output_dir} already exists and is not empty; refusing to overwrite it")


@contextlib.contextmanager
def main_rank_outputs(ctx: DistContext, *output_dirs: str | Path) -> Iterator[tuple[Path | None, ...]]:
    """Rank 0: a staged scratch directory per output, each committed when the block exits without error.

    The other ranks get ``None`` for each output: only rank 0 writes.
    """
    with contextlib.ExitStack() as stack:
        yield tuple(stack.enter_context(staged_output(d)) if ctx.is_main else None for d in output_dirs)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
