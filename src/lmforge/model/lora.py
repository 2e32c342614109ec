"""LoRA on a causal LM: which modules to adapt and the ``peft.LoraConfig`` for them.

Shared by the ``finetune_lora`` stage, which trains the adapters, and the training plan (:mod:`lmforge.plan`),
which counts them on a model built on the ``meta`` device.
"""

from __future__ import annotations

import peft
import torch
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from lmforge.config import LoraConfig
from lmforge.errors import ConfigError

_LLAMA_LIKE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Attention and MLP projections per architecture (QLoRA's finding: adapting all of them matters more
# than the rank). Keys are ``config.model_type``.
DEFAULT_TARGETS: dict[str, list[str]] = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gemma": _LLAMA_LIKE,
    "gemma2": _LLAMA_LIKE,
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "opt": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
}
# Module types peft's LoRA can wrap.
_LORA_TYPES = (torch.nn.Linear, Conv1D, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d)


def target_modules(model: PreTrainedModel, requested: list[str] | None) -> list[str]:
    """The modules to adapt: ``requested`` (each must name a module LoRA can wrap) or the architecture's default."""
    arch = model.config.model_type
    if requested is None:
        if arch not in DEFAULT_TARGETS:
            raise ConfigError(
                f"finetune_lora.target_modules: no default for architecture {arch!r} "
                f"(defaults exist for {', '.join(sorted(DEFAULT_TARGETS))}); set it explicitly"
            )
        requested = DEFAULT_TARGETS[arch]
    modules: dict[str, list[torch.nn.Module]] = {}
    for name, module in model.named_modules():
        modules.setdefault(name.rsplit(".", 1)[-1], []).append(module)
    for target in requested:
        if target not in modules:
            raise ConfigError(
                f"finetune_lora.target_modules: {target!r} matches no module of the {arch} model "
                f"(default targets: {', '.join(DEFAULT_TARGETS.get(arch, [])) or 'none'})"
            )
        wrong = {type(m).__name__ for m in modules[target] if not isinstance(m, _LORA_TYPES)}
        if wrong:
            raise ConfigError(
                f"finetune_lora.target_modules: {target!r} is a {', '.join(sorted(wrong))}; LoRA adapts Linear, "
                "Conv1D, Conv and Embedding modules only (use modules_to_save to train it in full)"
            )
    return list(requested)


def _check_modules_to_save(model: PreTrainedModel, names: list[str] | None) -> None:
    if not names:
        return
    known = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    for name in names:
        if name not in known:
            raise ConfigError(f"finetune_lora.modules_to_save: {name!r} matches no module of the model")


def tied_embedding_names(model: PreTrainedModel) -> tuple[str, str] | None:
    """``(input embedding, output head)`` module names (last component) when the two share one weight, else None."""
    inputs, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or head.weight is not inputs.weight:
        return None
    names = {id(module): name.rsplit(".", 1)[-1] for name, module in model.named_modules()}
    return names[id(inputs)], names[id(head)]


def _save_tied_embedding(names: list[str] | None, tied: tuple[str, str] | None) -> tuple[list[str] | None, bool]:
    """``modules_to_save`` with a tied embedding named by its head (how peft recognizes it), and whether it was there.

    peft trains one copy for a tied embedding and head only when the head is named and
    ``ensure_weight_tying`` is set; named by its input side alone (GPT-2's ``wte``), the embedding is
    trained, the head keeps the base weights, and merging unties the two.
    """
    if names is None or tied is None or not set(tied) & set(names):
        return names, False
    embedding, head = tied
    if head not in peft.utils.constants.EMBEDDING_LAYER_NAMES:
        raise ConfigError(
            f"finetune_lora.modules_to_save: the model ties {embedding!r} to its output head {head!r}, which peft "
            "cannot keep tied when trained; leave both out"
        )
    return [name for name in names if name not in tied] + [head], True


def peft_config(cfg: LoraConfig, model: PreTrainedModel, targets: list[str]) -> peft.LoraConfig:
    """The ``peft.LoraConfig`` for ``cfg`` on ``model`` (``fan_in_fan_out`` where weights are stored transposed).

    A token embedding tied to the output head, named by either module in ``modules_to_save``, is trained
    as one weight: the head follows the embedding, in training and merged. As a LoRA target it is refused.
    """
    n_layers = model.config.num_hidden_layers
    if cfg.layers_to_transform is not None and max(cfg.layers_to_transform) >= n_layers:
        raise ConfigError(
            f"finetune_lora.layers_to_transform: {max(cfg.layers_to_transform)} is out of range; "
            f"the model has blocks 0..{n_layers - 1}"
        )
    _check_modules_to_save(model, cfg.modules_to_save)
    tied = tied_embedding_names(model)
    if tied is not None and set(tied) & set(targets):
        # Merging a LoRA delta into the shared weight would change the head too, which the adapter never did.
        raise ConfigError(
            f"finetune_lora.target_modules: {'/'.join(tied)} is the token embedding tied to the output head; LoRA "
            "cannot adapt it as one weight: put it in modules_to_save to train it in full"
        )
    modules_to_save, tie = _save_tied_embedding(cfg.modules_to_save, tied)
    return peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        use_rslora=cfg.use_rslora,
        bias=cfg.bias,
        target_modules=targets,
        layers_to_transform=cfg.layers_to_transform,
        modules_to_save=modules_to_save,
        fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()),  # GPT-2's Conv1D stores W transposed
        ensure_weight_tying=tie,
        task_type="CAUSAL_LM",
    )
