"""Pipeline parallelism: the transformer blocks split by layers into stages, each step's micro-batches scheduled
through them (``torch.distributed.pipelining``).

Each stage is a block of ``data_parallel_shard × tensor_parallel`` consecutive ranks of the ``(pp, dp_shard, tp)``
mesh (:mod:`lmforge.train.fsdp2`). Every rank builds the model (and splits it tensor-parallel) as without stages,
then :func:`keep_stage` cuts it down in place to its own stage: the first stage keeps the embeddings, the last the
final norm and the head, and every stage its blocks under their original names (``model.layers.3`` stays
``model.layers.3``), so the distributed checkpoint and the exported weights carry the same names at any mesh. The
stage's forward (:func:`_llama_stage` / :func:`_gpt2_stage`) replaces the model's: token ids or the previous
stage's hidden states in, hidden states or logits out, with the causal mask and position embeddings the Hugging
Face model computes itself.

The loop's ``grad_accum`` micro-batches of a step are the pipeline's micro-batches, run by ``Schedule1F1B`` or
``ScheduleGPipe``; the schedule averages their gradients as the loop does, and FSDP2 reduce-scatters once, after
the last backward.

Tied embeddings (every lmforge model ties its head to the input embedding) live on two stages: the last stage
holds a copy of the embedding as its head, and after every backward the two gradients are summed between the
first and the last stage (as Megatron-LM does), so both copies take identical optimizer steps; the gradient norm
counts the weight once, and the checkpoint keys the copy's optimizer state by the embedding's name, as one process
does.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lmforge.errors import ConfigError
from lmforge.train.batches import IGNORE_INDEX
from lmforge.train.distributed import DistContext
from lmforge.train.losses import masked_ce


@dataclass(frozen=True)
class StageLayout:
    """Where an architecture keeps what the stages divide: module paths inside the causal LM."""

    embeddings: tuple[str, ...]
    blocks: str
    norm: str
    head: str = "lm_head"


LAYOUTS = {
    "llama": StageLayout(embeddings=("model.embed_tokens",), blocks="model.layers", norm="model.norm"),
    "gpt2": StageLayout(
        embeddings=("transformer.wte", "transformer.wpe"), blocks="transformer.h", norm="transformer.ln_f"
    ),
}


def stage_layers(n_layers: int, stages: int, stage: int) -> range:
    """The blocks of ``stage``: consecutive, the first ``n_layers % stages`` stages taking one more."""
    base, extra = divmod(n_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def _layout(model: torch.nn.Module) -> StageLayout:
    arch = model.config.model_type
    if arch not in LAYOUTS:
        raise ConfigError(f"distributed.mesh.pipeline_parallel: {arch} models are not split into stages (llama, gpt2)")
    return LAYOUTS[arch]


def _set(model: torch.nn.Module, path: str, module: torch.nn.Module | None) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def keep_stage(model: torch.nn.Module, stage: int, stages: int, sequence_mesh: DeviceMesh | None = None) -> bool:
    """Cut ``model`` down in place to pipeline stage ``stage`` of ``stages`` and give it the stage's forward.

    ``sequence_mesh``: the tensor-parallel mesh of a model whose residual stream is split by sequence (a Llama
    under tensor parallelism): stages send and receive whole hidden states, each rank continuing with its part.

    Returns whether the head is a copy of the tied input embedding (the last stage of a tied model), whose
    gradient :class:`Pipeline` sums with the first stage's.
    """
    layout = _layout(model)
    first, last = stage == 0, stage == stages - 1
    blocks = model.get_submodule(layout.blocks)
    kept = stage_layers(len(blocks), stages, stage)
    embedding = model.get_submodule(layout.embeddings[0])
    tied_copy = last and not first and model.get_submodule(layout.head).weight is embedding.weight
    if tied_copy:
        model.get_submodule(layout.head).weight = torch.nn.Parameter(embedding.weight.detach().clone())
    _set(model, layout.blocks, torch.nn.ModuleDict({str(i): blocks[i] for i in kept}))
    if not first:
        for path in layout.embeddings:
            _set(model, path, None)
    if not last:
        _set(model, layout.norm, None)
        _set(model, layout.head, None)
    stage_forward = _llama_stage if model.config.model_type == "llama" else _gpt2_stage
    model.forward = types.MethodType(partial(stage_forward, sequence_mesh=sequence_mesh), model)
    return tied_copy


def _receive(hidden: torch.Tensor, sequence_mesh: DeviceMesh | None) -> torch.Tensor:
    """The previous stage's whole hidden states as this rank's part of the sequence (when split by sequence)."""
    if sequence_mesh is None:
        return hidden
    part = hidden.chunk(sequence_mesh.size(), dim=1)[sequence_mesh.get_local_rank()]
    return DTensor.from_local(part, sequence_mesh, [Shard(1)], run_check=False)


def _send(hidden: torch.Tensor) -> torch.Tensor:
    """Hidden states whole, for the next stage (gathered when split by sequence)."""
    return hidden.full_tensor() if isinstance(hidden, DTensor) else hidden


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _causal_mask(model: torch.nn.Module, hidden: torch.Tensor, positions: torch.Tensor) -> Any:
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(
        config=model.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=positions
    )


def _llama_stage(self: torch.nn.Module, inputs: torch.Tensor, *, sequence_mesh: DeviceMesh | None) -> torch.Tensor:
    """One stage of a Llama: ``LlamaModel.forward``'s steps for the modules this stage holds."""
    inner = self.model
    hidden = inner.embed_tokens(inputs) if inner.embed_tokens is not None else _receive(inputs, sequence_mesh)
    positions = _positions(hidden)
    mask = _causal_mask(self, hidden, positions)
    rotary = inner.rotary_emb(hidden, position_ids=positions)
    for block in inner.layers.values():
        hidden = block(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
    if self.lm_head is None:
        return _send(hidden)
    return self.lm_head(inner.norm(hidden))


def _gpt2_stage(self: torch.nn.Module, inputs: torch.Tensor, *, sequence_mesh: DeviceMesh | None) -> torch.Tensor:
    """One stage of a GPT-2: ``GPT2Model.forward``'s steps for the modules this stage holds (its residual stream is
    never split by sequence: ``sequence_mesh`` is None)."""
    inner = self.transformer
    if inner.wte is not None:
        positions = _positions(inputs)
        hidden = inner.drop(inner.wte(inputs) + inner.wpe(positions))
    else:
        hidden, positions = inputs, _positions(inputs)
    mask = _causal_mask(self, hidden, positions)
    for block in inner.h.values():
        hidden = block(hidden, None, mask, position_ids=positions)
    if self.lm_head is None:
        return hidden
    return self.lm_head(inner.ln_f(hidden))


def _tied_groups(ctx: DistContext) -> dist.ProcessGroup | None:
    """The group of this rank and its counterpart on the other end of the pipeline (first and last stage at the
    same data- and tensor-parallel place); None on the stages between. Every rank creates every group."""
    per_stage = ctx.world_size // ctx.pipeline_parallel
    mine = None
    for place in range(per_stage):
        pair = [place, (ctx.pipeline_parallel - 1) * per_stage + place]
        group = dist.new_group(pair)
        if ctx.rank in pair:
            mine = group
    return mine


@dataclass
class Pipeline:
    """This rank's pipeline stage and schedule, and the collectives along the pipeline."""

    model: torch.nn.Module
    schedule: Any
    group: dist.ProcessGroup
    ctx: DistContext
    tied: torch.Tensor | None
    """The tied embedding or its copy on the first and last stage of a tied model; None elsewhere."""
    tied_group: dist.ProcessGroup | None
    tied_copy: bool
    """Whether :attr:`tied` is the last stage's copy (left out of the gradient norm)."""
    tied_names: dict[str, str]
    """The copy's name and the embedding's (the name a checkpoint keys its optimizer state by), or empty."""

    @property
    def first(self) -> bool:
        """Whether this rank runs the first stage (it reads the token ids)."""
        return self.ctx.pipeline_stage == 0

    @property
    def last(self) -> bool:
        """Whether this rank runs the last stage (it computes the loss)."""
        return self.ctx.pipeline_stage == self.ctx.pipeline_parallel - 1

    def step(self, batches: list[Mapping[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one step's micro-batches through the stages; the step's mean loss (on every
        rank) and the scored tokens. Tied gradients are summed before returning."""
        inputs = torch.cat([b["input_ids"] for b in batches])
        targets = torch.cat([b["targets"] for b in batches])
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.first else ()
        self.schedule.step(*args, target=targets if self.last else None, losses=losses)
        loss = torch.zeros((), dtype=torch.float64, device=inputs.device)
        if self.last:
            loss += torch.stack([x.detach().double() for x in losses]).mean()
        self._sum_over_stages(loss)
        self._sum_tied_gradients()
        return loss, (targets != IGNORE_INDEX).sum()

    @torch.no_grad()
    def eval_loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A forward pass of ``batch`` through the stages (hidden states sent on in fp32, which is exact for bf16);
        its mean loss on every rank and its scored tokens. The loop's evaluation calls it as its loss."""
        inputs, targets = batch["input_ids"], batch["targets"]
        per_stage = self.ctx.world_size // self.ctx.pipeline_parallel
        if self.first:
            hidden = inputs
        else:
            hidden = torch.empty((*inputs.shape, model.config.hidden_size), device=inputs.device)
            dist.recv(hidden, src=self.ctx.rank - per_stage)
        out = model(hidden)
        loss = torch.zeros((), dtype=torch.float64, device=inputs.device)
        if self.last:
            loss += masked_ce(out, targets, fused=False).double()
        else:
            dist.send(out.float().contiguous(), dst=self.ctx.rank + per_stage)
        self._sum_over_stages(loss)
        return loss, (targets != IGNORE_INDEX).sum()

    def _sum_over_stages(self, value: torch.Tensor) -> None:
        comm = value.cpu() if dist.get_backend(self.group) == "gloo" else value
        dist.all_reduce(comm, group=self.group)
        value.copy_(comm)

    def _sum_tied_gradients(self) -> None:
        if self.tied is None or self.tied.grad is None:
            return
        grad = self.tied.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        dist.all_reduce(local, group=self.tied_group)

    def norm_parameters(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """``params`` as the gradient norm counts them: without the last stage's copy of a tied embedding."""
        return [p for p in params if not (self.tied_copy and p is self.tied)]

    def norm_over_stages(self, norm: torch.Tensor) -> torch.Tensor:
        """The gradient norm of the whole model from this stage's ``norm``."""
        squared = norm.double().pow(2)
        self._sum_over_stages(squared)
        return squared.sqrt().to(norm.dtype)

    def gather_weights(self) -> dict[str, torch.Tensor] | None:
        """Every stage's complete weights on rank 0 in CPU memory (None elsewhere); called on every rank.

        Each stage's shards are gathered one tensor at a time on the stage's first rank, which sends them to
        rank 0; the head of a tied model comes from the last stage, under its own name.
        """
        keeps = self.ctx.rank % (self.ctx.world_size // self.ctx.pipeline_parallel) == 0
        state: dict[str, torch.Tensor] = {}
        for name, tensor in self.model.state_dict().items():
            whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if keeps:
                state[name] = whole.detach().cpu().clone()
        if not keeps:
            return None
        parts: list[Any] | None = [None] * self.ctx.pipeline_parallel if self.ctx.is_main else None
        dist.gather_object(state, parts, dst=0, group=self.group)
        if parts is None:
            return None
        return {name: tensor for part in parts for name, tensor in part.items()}


def build_pipeline(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    ctx: DistContext,
    schedule: str,
    micro_batches: int,
    shard: Callable[[torch.nn.Module], None],
) -> Pipeline:
    """Cut ``model`` down to this rank's stage, ``shard`` it (FSDP2, on the stage's ranks), and set up the schedule.

    The loss is the masked mean cross-entropy of causal language modelling (pretraining).
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stages, stage = ctx.pipeline_parallel, ctx.pipeline_stage
    layout = _layout(model)
    tied_source = model.get_submodule(layout.embeddings[0]).weight
    tied_model = model.get_submodule(layout.head).weight is tied_source
    split_sequence = ctx.tensor_parallel > 1 and model.config.model_type == "llama"
    tied_copy = keep_stage(model, stage, stages, mesh["tp"] if split_sequence else None)
    shard(model)
    tied_group = _tied_groups(ctx) if tied_model else None
    tied = None
    if tied_model and stage == 0:
        tied = model.get_submodule(layout.embeddings[0]).weight
    elif tied_copy:
        tied = model.get_submodule(layout.head).weight
    group = mesh["pp"].get_group()
    pipeline_stage = PipelineStage(model, stage, stages, ctx.device, group=group)
    schedule_class = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    runner = schedule_class(pipeline_stage, n_microbatches=micro_batches, loss_fn=masked_ce)
    tied_names = {f"{layout.head}.weight": f"{layout.embeddings[0]}.weight"} if tied_copy else {}
    pipeline = Pipeline(model, runner, group, ctx, tied, tied_group, tied_copy, tied_names)
    setattr(model, _PIPELINE_ATTRIBUTE, pipeline)
    return pipeline


_PIPELINE_ATTRIBUTE = "lmforge_pipeline"


def pipeline_of(model: torch.nn.Module) -> Pipeline | None:
    """The pipeline ``model`` is a stage of (:func:`build_pipeline`), or None."""
    return getattr(model, _PIPELINE_ATTRIBUTE, None)
