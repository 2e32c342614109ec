"""Building, loading and saving causal LMs in Hugging Face layout (safetensors + tokenizer)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from lmforge.config import ModelConfig
from lmforge.contracts import HISTORY_FILE
from lmforge.data.tokenizer import save_tokenizer
from lmforge.errors import InputDataError
from lmforge.model.folder import refuse_custom_code, weight_files

FUSED_GPT2_GELU = "gelu_pytorch_tanh"


def hf_config(cfg: ModelConfig, vocab_size: int, *, eos_id: int, pad_id: int) -> PretrainedConfig:
    """The ``transformers`` config for a model shape."""
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }
    if cfg.arch == "gpt2":
        # GPT-2's activation is the tanh approximation of GELU. ``gelu_new`` computes it with five elementwise
        # kernels (and as many in the backward pass); ``gelu_pytorch_tanh`` is the same function in one fused
        # kernel each way, about a third of the step time at small widths on a CPU.
        return GPT2Config(
            activation_function=FUSED_GPT2_GELU,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_embd=cfg.n_embd,
            n_positions=cfg.block_size,
            n_inner=cfg.intermediate_size,
            resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout,
            **common,
        )
    if cfg.rope_theta is not None:  # unset, transformers' default stays out of the call (and config.json as before)
        common["rope_theta"] = cfg.rope_theta
    return LlamaConfig(
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.kv_heads,
        hidden_size=cfg.n_embd,
        intermediate_size=cfg.mlp_width,
        max_position_embeddings=cfg.block_size,
        attention_dropout=cfg.dropout,
        tie_word_embeddings=True,
        **common,
    )


def build_model(cfg: ModelConfig, vocab_size: int, *, eos_id: int, pad_id: int, seed: int) -> PreTrainedModel:
    """A freshly initialized causal LM: Hugging Face's initialization, with values that depend on ``seed`` only.

    Under ``HfDeepSpeedConfig`` (ZeRO-3) the parameters come out partitioned, with the same values as a
    model built whole in one process (see :func:`seeded_init`). Either way the global RNG is left seeded
    with ``seed``.
    """
    config = hf_config(cfg, vocab_size, eos_id=eos_id, pad_id=pad_id)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)  # any parameter HF's initializers do not cover keeps a seeded default init
    model = AutoModelForCausalLM.from_config(config)
    seeded_init(model, seed)
    # Construction drew from the global RNG in one process (torch's default initializers) but not under
    # zero.Init; reseed so that what follows (dropout) starts from the same state on either path.
    torch.manual_seed(seed)
    return model


def set_gpt2_activation(model: PreTrainedModel, name: str) -> None:
    """Give every MLP of a GPT-2 model the activation ``name`` (a ``transformers`` ``ACT2FN`` key) and record it.

    ``gelu_new`` and :data:`FUSED_GPT2_GELU` are the same function; switching a model saved with the former
    to the latter makes it train faster with the same logits (within float rounding).
    """
    from transformers.activations import ACT2FN

    if model.config.model_type != "gpt2":
        raise ValueError(f"set_gpt2_activation: {model.config.model_type} is not a GPT-2 model")
    model.config.activation_function = name
    for block in model.transformer.h:
        block.mlp.act = ACT2FN[name]


def seeded_init(model: PreTrainedModel, seed: int) -> None:
    """Run the model's own ``_init_weights`` on every module again, each module from its own seed.

    ``from_config`` draws its initial values from the global RNG after construction has consumed an amount
    of it that depends on how the model is built: in one process torch's default initializers run first,
    under ``deepspeed.zero.Init`` they are skipped, so the same HF initializers start from another RNG
    offset and a ZeRO-3 run starts from other weights than a single-process run. Here each module's draws
    come from a generator seeded with (``seed``, its qualified name), made in fp32 on the CPU, so the values
    depend neither on construction, nor on the device or dtype the parameters live in, nor on ZeRO-3
    partitioning: a partitioned module is gathered, initialized (identically on every rank) and rank 0's
    values are partitioned again.

    Modules are visited children first, as ``PreTrainedModel.initialize_weights`` does (GPT-2 re-draws
    ``c_proj`` with its depth-scaled std after the layer's plain init), each with the ``_init_weights`` of its
    nearest ``PreTrainedModel``. A parameter tied to another one (``lm_head.weight`` is the input embedding)
    takes the value drawn for its source, as after HF's ``tie_weights``.
    """
    partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
    canonical = {id(p): name for name, p in model.named_parameters()}  # tied copies appear under one name
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for name, module, owner in _init_order(model, model, ""):
            touched = _touched_parameters(module, name)
            params = list({id(p): p for p in touched.values()}.values())
            ties = [p for qualified, p in touched.items() if canonical[id(p)] != qualified]
            with _gathered(params, partitioned), _fp32_on_cpu(params), _left_alone(ties):
                torch.default_generator.manual_seed(_module_seed(seed, name))
                owner._init_weights(module)


def _init_order(
    module: torch.nn.Module, owner: PreTrainedModel, name: str
) -> Iterator[tuple[str, torch.nn.Module, PreTrainedModel]]:
    for child_name, child in module.named_children():
        child_owner = child if isinstance(child, PreTrainedModel) else owner
        yield from _init_order(child, child_owner, f"{name}.{child_name}" if name else child_name)
    yield name, module, owner


def _touched_parameters(module: torch.nn.Module, name: str) -> dict[str, torch.nn.Parameter]:
    """The parameters ``_init_weights(module)`` may write: its own and its direct children's (GPT-2's ``c_proj``)."""
    prefix = f"{name}." if name else ""
    touched = {prefix + n: p for n, p in module.named_parameters(recurse=False)}
    for child_name, child in module.named_children():
        if not isinstance(child, PreTrainedModel):  # a sub-model initializes its own parameters
            touched |= {f"{prefix}{child_name}.{n}": p for n, p in child.named_parameters(recurse=False)}
    return touched


def _module_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # torch seeds are int64


@contextlib.contextmanager
def _gathered(params: list[torch.nn.Parameter], partitioned: bool) -> Iterator[None]:
    if not (partitioned and params):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):  # rank 0's values win on exit
        yield


@contextlib.contextmanager
def _fp32_on_cpu(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Point the parameters at fp32 CPU copies meanwhile, so that draws do not depend on device or dtype."""
    moved = [(p, p.data) for p in params if p.device.type != "cpu" or p.dtype != torch.float32]
    for p, data in moved:
        p.data = data.to("cpu", torch.float32)
    try:
        yield
    finally:
        for p, data in moved:
            data.copy_(p.data)
            p.data = data


@contextlib.contextmanager
def _left_alone(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Mark the parameters as initialized meanwhile; ``transformers.initialization`` then leaves them alone."""
    before = [(p, p.__dict__.get("_is_hf_initialized")) for p in params]
    for p in params:
        p._is_hf_initialized = True
    try:
        yield
    finally:
        for p, flag in before:
            if flag is None:
                del p._is_hf_initialized
            else:
                p._is_hf_initialized = flag


def check_model_dir(path: str | Path) -> Path:
    """Raise a clear error unless ``path`` is an HF causal-LM directory with weights inside it and no custom code.

    See :mod:`lmforge.model.folder` for what is refused and why.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise InputDataError(f"model directory {path}: no config.json")
    refuse_custom_code(path)
    weight_files(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    if not any(arch.endswith("ForCausalLM") or arch.endswith("LMHeadModel") for arch in config.architectures or []):
        raise InputDataError(f"model directory {path}: {config.architectures} is not a causal LM")
    return path


def load_causal_lm(path: str | Path, *, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a model directory written by any lmforge training stage (eval mode)."""
    model = AutoModelForCausalLM.from_pretrained(check_model_dir(path), dtype=dtype, trust_remote_code=False)
    return model.eval()


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the HF tokenizer stored in a tokenizer or model directory."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise InputDataError(f"{path}: no tokenizer.json (expected an HF fast tokenizer directory)")
    refuse_custom_code(path)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def skip_deepspeed_import_on_unwrap() -> None:
    """Stop ``save_pretrained`` from importing DeepSpeed in a process that never used it.

    ``save_pretrained`` unwraps the model with accelerate's ``extract_model_from_parallel``, which imports
    DeepSpeed whenever it is installed, only to test ``isinstance(model, DeepSpeedEngine)``: 2.5 s on import and
    0.6 s more at exit, in every stage that saves a model. No object is a ``DeepSpeedEngine`` before DeepSpeed is
    imported, so accelerate's check is narrowed to "installed and already imported"; once a stage imports it
    (``train.backend: deepspeed``), the check is accelerate's own again. Safe to call any number of times.
    """
    try:
        from accelerate.utils import other
    except ImportError:
        return
    installed = other.is_deepspeed_available
    if getattr(installed, "lmforge_narrowed", False):
        return

    def imported_and_installed() -> bool:
        return "deepspeed" in sys.modules and installed()

    imported_and_installed.lmforge_narrowed = True  # type: ignore[attr-defined]
    other.is_deepspeed_available = imported_and_installed


def save_model_dir(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | Path,
    *,
    history: dict[str, Any] | None = None,
) -> Path:
    """Save weights (safetensors), config, tokenizer and an optional training history into ``out_dir``."""
    out_dir = Path(out_dir)
    skip_deepspeed_import_on_unwrap()
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(tokenizer, out_dir)
    if history is not None:
        (out_dir / HISTORY_FILE).write_text(json.dumps(history, indent=1), encoding="utf-8")
    return out_dir


def count_parameters(model: torch.nn.Module, *, trainable_only: bool = False) -> int:
    """Number of (trainable) parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
