"""Pipeline stages without a process group: how blocks are split, and that a model cut into stages computes, stage
after stage, the whole model's logits (and keeps the parameter names a checkpoint is keyed by)."""

from __future__ import annotations

import copy

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.model.build import build_model
from lmforge.train.pipeline import keep_stage, stage_layers

SHAPES = {
    "llama": ModelConfig(arch="llama", n_layer=3, n_head=4, n_kv_head=2, n_embd=16, block_size=16),
    "gpt2": ModelConfig(arch="gpt2", n_layer=3, n_head=2, n_embd=16, block_size=16),
}


@pytest.mark.parametrize(
    ("layers", "stages", "expected"),
    [(4, 2, [[0, 1], [2, 3]]), (3, 2, [[0, 1], [2]]), (7, 3, [[0, 1, 2], [3, 4], [5, 6]]), (2, 2, [[0], [1]])],
)
def test_blocks_are_split_into_consecutive_stages_the_first_ones_taking_the_rest(layers, stages, expected):
    assert [list(stage_layers(layers, stages, s)) for s in range(stages)] == expected


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("stages", [2, 3])
def test_stages_in_a_row_compute_the_whole_models_logits_and_keep_its_names(arch, stages):
    model = build_model(SHAPES[arch], 64, eos_id=0, pad_id=1, seed=0).eval()
    names = set(model.state_dict())
    parts = [copy.deepcopy(model) for _ in range(stages)]
    copies = [keep_stage(part, stage, stages) for stage, part in enumerate(parts)]
    tokens = torch.randint(0, 64, (2, 12))
    hidden = tokens
    with torch.no_grad():
        for part in parts:
            hidden = part(hidden)
        whole = model(input_ids=tokens).logits
    torch.testing.assert_close(hidden, whole, rtol=0, atol=1e-6)
    kept = [set(part.state_dict()) for part in parts]
    assert set().union(*kept) == names
    assert sum(map(len, kept)) == len(names)  # each name on one stage (the tied head on the last)
    assert copies == [False] * (stages - 1) + [True]
    head, embedding = parts[-1].lm_head.weight, model.get_input_embeddings().weight
    assert head is not embedding and torch.equal(head, embedding)
