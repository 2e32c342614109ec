"""The tests' tiny training runs: the 2-layer GPT-2 of the shared fixtures, trained in fp32 on 32-token windows."""

from __future__ import annotations

from typing import Any

from lmforge.config import ModelConfig, PretrainConfig, TrainConfig

TINY_MODEL = ModelConfig(arch="gpt2", n_layer=2, n_head=2, n_embd=32, block_size=64)


def tiny_train(**fields: Any) -> TrainConfig:
    """fp32 training on 32-token windows at lr 3e-3 decaying to 3e-4, with ``fields`` set over those."""
    return TrainConfig(**{"seq_len": 32, "lr": 3e-3, "min_lr": 3e-4, "precision": "fp32", **fields})


def tiny_pretrain(**train: Any) -> PretrainConfig:
    """Pretraining :data:`TINY_MODEL` with ``tiny_train(**train)``."""
    return PretrainConfig(model=TINY_MODEL, train=tiny_train(**train))
