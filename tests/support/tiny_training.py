"""The tests' tiny training runs: the 2-layer GPT-2 of the shared fixtures, trained in fp32 on 32-token windows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmforge.config import ModelConfig, PretrainConfig, TrainConfig
from lmforge.contracts import HISTORY_FILE

TINY_MODEL = ModelConfig(arch="gpt2", n_layer=2, n_head=2, n_embd=32, block_size=64)


def tiny_train(**fields: Any) -> TrainConfig:
    """fp32 training on 32-token windows at lr 3e-3 decaying to 3e-4, with ``fields`` set over those."""
    return TrainConfig(**{"seq_len": 32, "lr": 3e-3, "min_lr": 3e-4, "precision": "fp32", **fields})


def tiny_pretrain(**train: Any) -> PretrainConfig:
    """Pretraining :data:`TINY_MODEL` with ``tiny_train(**train)``."""
    return PretrainConfig(model=TINY_MODEL, train=tiny_train(**train))


def read_history(model_dir: Path, steps: int) -> dict:
    """The training history a stage wrote into ``model_dir``, checked to log every one of ``steps`` steps."""
    history = json.loads((model_dir / HISTORY_FILE).read_text())
    assert history["step"] == list(range(1, steps + 1))
    return history


def worst_difference(a: list[float], b: list[float]) -> float:
    """The largest absolute difference between two equally long series."""
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
