"""Preflight refuses an fsdp2 mesh that the launch's processes do not fill, before any GPU is requested."""

from __future__ import annotations

import json

import pytest

from lmforge.config import LaunchConfig
from lmforge.errors import PreflightError
from lmforge.launch import world_size
from lmforge.preflight.preflight import run_checks

MESH = {"train.distributed.backend": "fsdp2", "train.distributed.mesh.data_parallel_shard": 4}


def _run(tmp_path, launch: LaunchConfig):
    corpus, qa = tmp_path / "docs.jsonl", tmp_path / "qa.jsonl"
    corpus.write_text(json.dumps({"text": "a scene with enough words in it to be a document"}) + "\n")
    qa.write_text(json.dumps({"prompt": "hi", "response": "hello"}) + "\n")
    return run_checks(
        corpus_uri=str(corpus), qa_uri=str(qa), release_root=str(tmp_path / "registry"), s3_secret_name="",
        preset="tiny-cpu", stage_overrides={"pretrain": MESH}, launch=launch,
    )  # fmt: skip


def test_mesh_the_launch_does_not_fill_fails_preflight_naming_the_stage_fields_and_world_size(tmp_path):
    with pytest.raises(PreflightError) as info:
        _run(tmp_path, LaunchConfig(gpus_per_node=2))
    assert (
        "stage_configs: pretrain.train.distributed.mesh: pipeline_parallel (1) × data_parallel_shard (4) × "
        "tensor_parallel (1) must equal the world size, but WORLD_SIZE is 2"
    ) in str(info.value)


def test_mesh_the_launch_fills_passes_preflight(tmp_path):
    assert _run(tmp_path, LaunchConfig(gpus_per_node=4)).checks["stage_configs"] == "ok"


@pytest.mark.parametrize(("nodes", "gpus", "expected"), [(1, 0, 1), (1, 8, 8), (4, 8, 32), (2, 0, 2)])
def test_world_size_is_one_process_per_gpu_or_per_pod_without_gpus(nodes, gpus, expected):
    assert world_size(LaunchConfig(num_nodes=nodes, gpus_per_node=gpus)) == expected
