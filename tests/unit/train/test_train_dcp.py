"""fsdp2 checkpoints: DCP round trip of model and optimizer, an index of another model refused by name, and an
index that would run code when unpickled refused without running it."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.errors import ArtifactIncompleteError
from lmforge.model.build import build_model
from lmforge.train import dcp

SHAPE = ModelConfig(arch="llama", n_layer=1, n_head=2, n_embd=16, block_size=16)


def _trained(seed: int, shape: ModelConfig = SHAPE) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(shape, 64, eos_id=0, pad_id=1, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(8).reshape(1, 8)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return model, optimizer


def test_model_and_optimizer_state_round_trip(tmp_path):
    model, optimizer = _trained(seed=0)
    dcp.save(model, optimizer, tmp_path)
    dcp.check(tmp_path, model)
    fresh, fresh_optimizer = _trained(seed=1)
    dcp.load(fresh, fresh_optimizer, tmp_path)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    saved, loaded = optimizer.state_dict(), fresh_optimizer.state_dict()
    for index, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(value, loaded["state"][index][key]), (index, key)
    assert saved["param_groups"] == loaded["param_groups"]


def test_index_of_another_model_is_refused_naming_the_tensor(tmp_path):
    model, optimizer = _trained(seed=0)
    dcp.save(model, optimizer, tmp_path)
    wider, _ = _trained(seed=0, shape=SHAPE.model_copy(update={"intermediate_size": 48}))
    expected = r"'model.layers.0.mlp.gate_proj.weight' has shape \[64, 16\], the model's is \[48, 16\]"
    with pytest.raises(ArtifactIncompleteError, match=expected):
        dcp.check(tmp_path, wider)


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("protocol", [2, 4])
def test_index_that_would_run_code_is_refused_without_running_it(tmp_path, protocol):
    marker = tmp_path / "ran"
    (tmp_path / dcp.DCP_DIR).mkdir()
    (tmp_path / dcp.DCP_DIR / dcp.METADATA).write_bytes(pickle.dumps(_RunsCode(str(marker)), protocol=protocol))
    with pytest.raises(ArtifactIncompleteError, match=r"\.metadata: not a readable checkpoint index"):
        dcp.check(tmp_path, torch.nn.Linear(2, 2))
    assert not marker.exists()
