"""The plan's per-rank model-state estimate for FSDP2 against what each rank really holds: the bytes of its local
shards of the weights, gradients and AdamW moments after one step under torchrun (gloo, CPU)."""

from __future__ import annotations

import json

import pytest

from lmforge.plan import count_parameters, model_state_bytes, pipeline_stage_parameters
from tests.support import fsdp2_memory_child as child
from tests.support.distributed_child import torchrun

pytestmark = pytest.mark.slow


MESHES = {"dp2": {"data_parallel_shard": 2}, "tp2": {"tensor_parallel": 2}, "pp2": {"pipeline_parallel": 2}}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, list[dict[str, int]]]:
    """Each rank's record of ``MESHES[name]`` on 2 ranks, by name: one job measures every mesh for all the tests."""
    out = tmp_path_factory.mktemp("memory")
    torchrun(child.__file__, json.dumps(MESHES), str(out), nproc=2, timeout=300)
    return {name: [json.loads((out / name / f"rank{r}.json").read_text()) for r in range(2)] for name in MESHES}


@pytest.mark.parametrize("mesh", ["dp2", "tp2"])
def test_the_plans_model_state_per_rank_is_within_15_percent_of_the_sharded_bytes(mesh, measured):
    parameters, _ = count_parameters(child.MODEL, child.VOCAB)
    estimate = model_state_bytes(backend="fsdp2", zero_stage=0, ranks=2, trained=parameters)
    for rank in measured[mesh]:
        assert rank["parameters"] == parameters  # the plan counts the model the loop builds
        held = rank["weights"] + rank["gradients"] + rank["optimizer"]
        assert abs(held - estimate) <= 0.15 * held, (mesh, rank, estimate)


def test_the_plans_busiest_pipeline_stage_is_within_15_percent_of_the_fullest_ranks_bytes(measured):
    """Two stages on two ranks: each rank holds its stage's blocks whole (no data-parallel sharding), the first
    the embedding, the last the final norm and a copy of the tied embedding as its head."""
    ranks = measured["pp2"]
    parameters, _ = count_parameters(child.MODEL, child.VOCAB)
    stage = pipeline_stage_parameters(child.MODEL, child.VOCAB, parameters, 2)
    estimate = model_state_bytes(backend="fsdp2", zero_stage=0, ranks=1, trained=stage)
    fullest = max(rank["weights"] + rank["gradients"] + rank["optimizer"] for rank in ranks)
    assert abs(fullest - estimate) <= 0.15 * fullest, (ranks, estimate)


def test_tensor_parallel_norms_see_their_part_of_the_sequence_only(measured):
    """Sequence parallelism: with tensor_parallel 2 each rank's norms hold half of the 16 positions, which is what
    the plan's activations per rank assume (everything a Llama layer keeps divided by tensor_parallel)."""
    assert [rank["norm_positions"] for rank in measured["tp2"]] == [8, 8]
