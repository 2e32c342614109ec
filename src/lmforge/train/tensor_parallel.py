"""Tensor-parallel plans for the Llama and GPT-2 shapes lmforge builds (Megatron-style, on the mesh's ``tp`` dimension).

Each block's attention is split by heads and its MLP by hidden width: the column-parallel matrices (q, k and v; the
MLP's first layer) compute each rank's heads or hidden units from the whole input, the row-parallel ones (the
attention output; the MLP's second layer) take that share and sum their partial outputs (one all-reduce each). The
embedding is split by vocabulary rows and the (tied) head by vocabulary columns, its output gathered whole, so the
loss sees ordinary logits. A Llama's residual stream and RMS norms are split by sequence between those matrices
(sequence parallelism); a GPT-2's, its LayerNorms and position embeddings stay whole on every rank. Every activation
is replicated or split exactly, so a fp32 step equals one process's up to float rounding.

GPT-2's layers are ``transformers`` ``Conv1D`` modules, whose weight is ``(in, out)`` (the transpose of
``nn.Linear``'s), so they get their own styles. Its q, k and v are one fused matrix (``attn.c_attn``, the columns of
q, then k, then v): a contiguous column split would give rank 0 all of q, so before splitting, the columns are
permuted to ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (each rank's heads of q, k and v side by side) and each attention
module's ``split_size`` and ``num_heads`` become its rank's share. That order lives only in memory: :func:`hf_order`
puts a gathered state dict back into Hugging Face's order, and :func:`hf_ordered_state` / :func:`load_hf_ordered`
give distributed checkpoints HF's order, so checkpoints and exports are the plain model's at any mesh.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any, ClassVar

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.pytorch_utils import Conv1D

from lmforge.config.train import tensor_parallel_problem
from lmforge.errors import ConfigError

_LLAMA_ATTENTION_COLUMNS = ("q_proj", "k_proj", "v_proj")
_LLAMA_MLP_COLUMNS = ("gate_proj", "up_proj")
_FUSED_QKV = 3  # GPT-2's c_attn: q, k and v side by side
_FUSED_QKV_TENSORS = (".attn.c_attn.weight", ".attn.c_attn.bias")


def check_tensor_parallel(model: torch.nn.Module, tensor_parallel: int) -> None:
    """Refuse a model whose heads, key/value heads or MLP width ``tensor_parallel`` does not divide, or an
    architecture without a plan (neither Llama nor GPT-2)."""
    config = model.config
    heads = config.num_attention_heads
    problem = tensor_parallel_problem(
        tensor_parallel,
        arch=config.model_type,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        mlp_width=getattr(config, "intermediate_size", None)
        or getattr(config, "n_inner", None)
        or 4 * config.hidden_size,
    )
    if problem:
        raise ConfigError(problem)


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split ``model`` (a Llama or a GPT-2, by ``model.config.model_type``) over ``tp_mesh`` in place.

    A tied head is tied again to the split embedding table (both are split by vocabulary rows).
    """
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    gpt2 = model.config.model_type == "gpt2"
    split, around = (_gpt2_plan(model), {}) if gpt2 else _llama_plan(model)
    for name, style in split.items():
        module = model.get_submodule(name)
        expected = (Conv1D,) if isinstance(style, _Conv1DStyle) else (torch.nn.Linear, torch.nn.Embedding)
        if not isinstance(module, expected):
            raise ConfigError(
                f"distributed.mesh.tensor_parallel: {name} is a {type(module).__name__}, not a "
                f"{' or '.join(kind.__name__ for kind in expected)} (adapters and custom layers are not split); "
                "use tensor_parallel: 1"
            )
    if gpt2:
        for block in model.transformer.h:
            _split_attention_heads(block.attn, tp_mesh.size())
    parallelize_module(model, tp_mesh, split | around)
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight


def _llama_plan(model: torch.nn.Module) -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """The split matrices (q/k/v and MLP gate/up column-wise, o and down row-wise, embeddings and head by vocabulary
    rows) and the modules around them, split by sequence (sequence parallelism, Korthikanti et al. 2022): the RMS
    norms and the residual stream hold ``seq_len / tensor_parallel`` positions per rank, gathered before attention
    and the MLP and reduce-scattered after them. Rotary embeddings stay whole on every rank."""
    sequence, whole = Shard(1), Replicate()
    split: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=whole, output_layouts=sequence, use_local_output=False),
        "lm_head": ColwiseParallel(input_layouts=sequence, output_layouts=whole),
    }
    around: dict[str, ParallelStyle] = {"model.norm": SequenceParallel()}
    for index in range(len(model.model.layers)):
        block = f"model.layers.{index}"
        split |= {f"{block}.self_attn.{name}": ColwiseParallel() for name in _LLAMA_ATTENTION_COLUMNS}
        split |= {f"{block}.mlp.{name}": ColwiseParallel() for name in _LLAMA_MLP_COLUMNS}
        split |= {
            f"{block}.{name}": RowwiseParallel(output_layouts=sequence, use_local_output=False)
            for name in ("self_attn.o_proj", "mlp.down_proj")
        }
        around |= {
            f"{block}.input_layernorm": SequenceParallel(),
            f"{block}.post_attention_layernorm": SequenceParallel(),
            f"{block}.self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": sequence}, desired_input_kwarg_layouts={"hidden_states": whole}
            ),
            f"{block}.mlp": PrepareModuleInput(input_layouts=(sequence,), desired_input_layouts=(whole,)),
        }
    return split, around


def _gpt2_plan(model: torch.nn.Module) -> dict[str, ParallelStyle]:
    """c_attn (once its columns are each rank's heads) and c_fc column-wise, both c_proj row-wise, ``wte`` by
    vocabulary rows and the head by vocabulary columns."""
    plan: dict[str, ParallelStyle] = {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for index in range(len(model.transformer.h)):
        prefix = f"transformer.h.{index}"
        plan |= {f"{prefix}.attn.c_attn": Conv1DColwiseParallel(), f"{prefix}.mlp.c_fc": Conv1DColwiseParallel()}
        plan |= {f"{prefix}.attn.c_proj": Conv1DRowwiseParallel(), f"{prefix}.mlp.c_proj": Conv1DRowwiseParallel()}
    return plan


def _split_attention_heads(attn: GPT2Attention, ranks: int) -> None:
    """Permute ``c_attn``'s columns to ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` and make the module split its rank's
    ``3·h/ranks`` outputs into its ``num_heads/ranks`` heads of q, k and v (the forward views by head size)."""
    order = fused_qkv_order(attn.embed_dim, ranks)
    with torch.no_grad():
        attn.c_attn.weight.copy_(attn.c_attn.weight[:, order])
        attn.c_attn.bias.copy_(attn.c_attn.bias[order])
    attn.split_size = attn.embed_dim // ranks
    attn.num_heads //= ranks


def fused_qkv_order(width: int, ranks: int) -> torch.Tensor:
    """HF column of each column of the permuted fused projection: ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``, where
    ``q_r`` are rank ``r``'s ``width/ranks`` columns of q (its heads)."""
    share = width // ranks
    return torch.arange(_FUSED_QKV * width).view(_FUSED_QKV, ranks, share).transpose(0, 1).reshape(-1)


class _Conv1DStyle:
    """Mixed into torch's ``ColwiseParallel`` or ``RowwiseParallel``: split a ``transformers`` ``Conv1D`` (weight
    ``(in, out)``) by the ``placements`` of its parameters, its input and output laid out as that style lays out an
    ``nn.Linear``'s."""

    placements: ClassVar[dict[str, Placement]]

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        def split(_: str, layer: torch.nn.Module, mesh: DeviceMesh) -> None:
            for name, param in list(layer.named_parameters(recurse=False)):
                shard = distribute_tensor(param, mesh, [self.placements[name]])
                layer.register_parameter(name, torch.nn.Parameter(shard, requires_grad=param.requires_grad))

        return distribute_module(
            module,
            device_mesh,
            split,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class Conv1DColwiseParallel(_Conv1DStyle, ColwiseParallel):
    """Column-parallel ``Conv1D``: weight and bias split by output columns; the whole input in, its share out."""

    placements: ClassVar[dict[str, Placement]] = {"weight": Shard(1), "bias": Shard(0)}


class Conv1DRowwiseParallel(_Conv1DStyle, RowwiseParallel):
    """Row-parallel ``Conv1D``: weight split by input rows, bias whole (added once to the summed output); a share of
    the input in, the whole output out."""

    placements: ClassVar[dict[str, Placement]] = {"weight": Shard(0), "bias": Replicate()}
    desired_input_layouts = (Shard(-1),)


def permuted_columns(model: torch.nn.Module, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """``{name: HF column of each column}`` for those of ``names`` (state-dict keys of ``model``, or of every pipeline
    stage of it) held in permuted order: the fused q/k/v weights and biases (permuted along their last dimension),
    when :func:`apply_tensor_parallel` split ``model``'s attention (every block alike)."""
    for module in model.modules():
        if isinstance(module, GPT2Attention) and module.split_size != module.embed_dim:
            order = fused_qkv_order(module.embed_dim, module.embed_dim // module.split_size)
            return {name: order for name in names if name.endswith(_FUSED_QKV_TENSORS)}
    return {}


def hf_order(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state``, ``model``'s gathered (whole) weights, with the permuted columns back in HF's order, in place."""
    for name, order in permuted_columns(model, state).items():
        state[name] = _reorder(state[name], torch.argsort(order))
    return state


def _reorder(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tensor``'s last dimension (the columns of a Conv1D weight, the entries of its bias) taken at ``index``."""
    return tensor.index_select(tensor.dim() - 1, index.to(tensor.device))


@torch.no_grad()
def hf_ordered_state(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``model``'s DCP state ``{"model": ..., "optimizer": ...}`` whose permuted tensors (weights and their
    optimizer moments) are new DTensors in HF's order, laid out as the originals; every other entry is shared.

    Each is gathered whole, reordered and split again, one tensor at a time.
    """
    model_state, moments = dict(state["model"]), dict(state["optimizer"]["state"])
    for name, order in permuted_columns(model, model_state).items():
        inverse = torch.argsort(order)
        model_state[name] = _redistributed(model_state[name], inverse)
        moments[name] = {
            key: _redistributed(value, inverse) if _is_moment(value, model_state[name]) else value
            for key, value in moments.get(name, {}).items()
        }
    return {**state, "model": model_state, "optimizer": {**state["optimizer"], "state": moments}}


@torch.no_grad()
def load_hf_ordered(model: torch.nn.Module, state: dict[str, Any], ordered: dict[str, Any]) -> None:
    """Copy the HF-ordered tensors of ``ordered`` (:func:`hf_ordered_state` of ``state``, since loaded) into
    ``state``'s permuted tensors."""
    for name, order in permuted_columns(model, state["model"]).items():
        pairs = [(state["model"][name], ordered["model"][name])]
        saved = ordered["optimizer"]["state"].get(name, {})
        pairs += [(value, saved[key]) for key, value in state["optimizer"]["state"].get(name, {}).items()]
        for target, loaded in pairs:
            if _is_moment(target, state["model"][name]):
                target.to_local().copy_(_redistributed(loaded, order).to_local())


def _is_moment(value: Any, weight: DTensor) -> bool:
    """Whether an optimizer state entry is a per-element tensor of ``weight`` (its own, or a moment of it)."""
    return isinstance(value, DTensor) and value.shape == weight.shape


def _redistributed(tensor: DTensor, index: torch.Tensor) -> DTensor:
    """``tensor`` with its last dimension taken at ``index``, laid out as ``tensor`` (gathered whole meanwhile)."""
    whole = _reorder(tensor.full_tensor(), index)
    return distribute_tensor(whole, tensor.device_mesh, tensor.placements, src_data_rank=None)
