"""The parts of the fsdp2 backend that need no process group: precision policy, block lookup, TP refusals."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.errors import ConfigError
from lmforge.model.build import build_model
from lmforge.train.fsdp2 import mixed_precision, transformer_blocks
from lmforge.train.tensor_parallel import check_tensor_parallel

LLAMA = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=16, block_size=16)


def _model(shape: ModelConfig) -> torch.nn.Module:
    return build_model(shape, 64, eos_id=0, pad_id=1, seed=0)


def test_bf16_computes_in_bf16_and_reduces_in_fp32_while_fp32_casts_nothing():
    bf16, fp32 = mixed_precision("bf16"), mixed_precision("fp32")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert (fp32.param_dtype, fp32.reduce_dtype) == (None, None)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_blocks_are_found_in_both_shapes_lmforge_builds(arch):
    shape = LLAMA if arch == "llama" else ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=16)
    assert len(transformer_blocks(_model(shape))) == 2


@pytest.mark.parametrize(
    ("shape", "tp", "expected"),
    [
        (LLAMA, 4, "tensor_parallel (4) must divide the model's key/value heads (2)"),
        (LLAMA.model_copy(update={"intermediate_size": 15}), 2, "must divide the model's MLP width (15)"),
        (
            ModelConfig(n_head=2, n_embd=16, block_size=16),
            4,
            "tensor_parallel (4) must divide the model's attention heads (2)",
        ),
        (
            ModelConfig(n_head=4, n_embd=16, intermediate_size=18, block_size=16),
            4,
            "must divide the model's MLP width (18)",
        ),
    ],
)
def test_a_model_tensor_parallelism_cannot_split_is_refused_at_setup(shape, tp, expected):
    """The base model's own config.json decides at setup (the pretrain config's shape does not apply to it)."""
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        check_tensor_parallel(_model(shape), tp)


@pytest.mark.parametrize("shape", [LLAMA, ModelConfig(n_head=4, n_embd=16, block_size=16)], ids=["llama", "gpt2"])
def test_a_model_tensor_parallelism_can_split_passes(shape):
    check_tensor_parallel(_model(shape), 2)
