"""Building, loading and saving causal LMs in Hugging Face layout (safetensors + tokenizer)."""

from __future__ import annotations

import json
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
from lmforge.errors import InputDataError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
HISTORY_FILE = "training_history.json"


def hf_config(cfg: ModelConfig, vocab_size: int, *, eos_id: int, pad_id: int) -> PretrainedConfig:
    """The ``transformers`` config for a model shape."""
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }
    if cfg.arch == "gpt2":
        return GPT2Config(
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_embd=cfg.n_embd,
            n_positions=cfg.block_size,
            resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout,
            **common,
        )
    return LlamaConfig(
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_head,
        hidden_size=cfg.n_embd,
        intermediate_size=4 * cfg.n_embd,
        max_position_embeddings=cfg.block_size,
        attention_dropout=cfg.dropout,
        tie_word_embeddings=True,
        **common,
    )


def build_model(cfg: ModelConfig, vocab_size: int, *, eos_id: int, pad_id: int, seed: int) -> PreTrainedModel:
    """A freshly initialized causal LM (HF initialization, deterministic for ``seed``)."""
    torch.manual_seed(seed)
    config = hf_config(cfg, vocab_size, eos_id=eos_id, pad_id=pad_id)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config)


def check_model_dir(path: str | Path) -> Path:
    """Raise a clear error unless ``path`` is an HF causal-LM directory with weights."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise InputDataError(f"model directory {path}: no config.json")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise InputDataError(f"model directory {path}: no weights ({' or '.join(WEIGHT_FILES)})")
    config = AutoConfig.from_pretrained(path)
    if not any(arch.endswith("ForCausalLM") or arch.endswith("LMHeadModel") for arch in config.architectures or []):
        raise InputDataError(f"model directory {path}: {config.architectures} is not a causal LM")
    return path


def load_causal_lm(path: str | Path, *, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a model directory written by any lmforge training stage (eval mode)."""
    model = AutoModelForCausalLM.from_pretrained(check_model_dir(path), dtype=dtype)
    return model.eval()


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the HF tokenizer stored in a tokenizer or model directory."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise InputDataError(f"{path}: no tokenizer.json (expected an HF fast tokenizer directory)")
    return AutoTokenizer.from_pretrained(path)


def save_model_dir(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | Path,
    *,
    history: dict[str, Any] | None = None,
) -> Path:
    """Save weights (safetensors), config, tokenizer and an optional training history into ``out_dir``."""
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if history is not None:
        (out_dir / HISTORY_FILE).write_text(json.dumps(history, indent=1), encoding="utf-8")
    return out_dir


def count_parameters(model: torch.nn.Module, *, trainable_only: bool = False) -> int:
    """Number of (trainable) parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
