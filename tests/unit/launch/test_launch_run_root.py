"""The GPU presets' templated checkpoint dir ({run_root}/checkpoints/{run_id}/{stage}) is filled in where training
runs: in the step's process from its ``run_root`` parameter and ``$LMFORGE_RUN_ID``, and in a multi-node job's pods,
which get both from the step (they inherit nothing of its environment)."""

from __future__ import annotations

import json

import pytest

from lmforge import storage
from lmforge.artifacts import read_manifest
from lmforge.launch import run_training_stage
from lmforge.run_context import RUN_ID_ENV, RUN_ROOT_ENV
from tests.unit.launch.test_launch_stage import OVERRIDES, RUN, _Artifact, _io, _job_config, cluster  # noqa: F401 - cluster: a fixture

TEMPLATE = {"train.checkpoint": {"dir": "{run_root}/checkpoints/{run_id}/{stage}", "every_steps": 2, "keep_last": 3}}


def _steps(root: str) -> list[str]:
    return sorted({name.split("/", 1)[0] for name in storage.list_files(root) if name.startswith("step-")})


def test_the_pretrain_step_checkpoints_under_its_run_root_and_run_id(tmp_path, monkeypatch, tiny_shards_dir,
                                                                     tiny_tokenizer_dir):  # fmt: skip
    from lmforge_kfp.components import load_component

    monkeypatch.setenv(RUN_ID_ENV, RUN)  # the pipeline maps it from the pod label (kfp.local: lmforge run sets it)
    monkeypatch.setenv(RUN_ROOT_ENV, "restored-after-the-test")
    pretrain = load_component("pretrain")
    pretrain.python_func(
        shards=_Artifact(tiny_shards_dir), tokenizer=_Artifact(tiny_tokenizer_dir), model=_Artifact(tmp_path / "m"),
        metrics=_Artifact(tmp_path / "metrics"), curves=_Artifact(tmp_path / "curves.html"),
        overrides=json.dumps({**OVERRIDES, **TEMPLATE}), run_root=str(tmp_path / "releases"),
    )  # fmt: skip
    assert _steps(str(tmp_path / "releases" / "checkpoints" / RUN / "pretrain")) == ["step-00000002", "step-00000004"]
    assert read_manifest(tmp_path / "m", verify=True)["kind"] == "model"


def test_without_a_run_root_a_templated_checkpoint_dir_fails_before_training_naming_the_variable(
    tmp_path, monkeypatch, capsys, tiny_shards_dir, tiny_tokenizer_dir
):
    from lmforge_kfp.components import load_component

    monkeypatch.setenv(RUN_ID_ENV, RUN)
    monkeypatch.delenv(RUN_ROOT_ENV, raising=False)
    pretrain = load_component("pretrain")
    with pytest.raises(SystemExit) as exited:
        pretrain.python_func(
            shards=_Artifact(tiny_shards_dir), tokenizer=_Artifact(tiny_tokenizer_dir), model=_Artifact(tmp_path / "m"),
            metrics=_Artifact(tmp_path / "metrics"), curves=_Artifact(tmp_path / "curves.html"),
            overrides=json.dumps({**OVERRIDES, **TEMPLATE}),
        )  # fmt: skip
    assert exited.value.code == 2
    assert f"needs ${RUN_ROOT_ENV}" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
@pytest.mark.s3
def test_a_two_node_job_gets_the_run_id_and_root_and_checkpoints_there(
    tmp_path, monkeypatch, cluster, s3_server, tiny_shards_dir, tiny_tokenizer_dir  # noqa: F811
):  # fmt: skip
    server, api, bucket = cluster
    root = f"s3://{bucket}/run-root"
    monkeypatch.setenv(RUN_ROOT_ENV, root)  # what the component sets from its run_root parameter
    run_training_stage(
        "pretrain", _job_config(s3_server), _io(tiny_shards_dir, tiny_tokenizer_dir, tmp_path / "model"),
        preset="tiny-cpu", overrides={**OVERRIDES, **TEMPLATE}, image="ghcr.io/lmforge/lmforge-train:test", run_id=RUN,
        staging_uri=f"s3://{bucket}/staging", api_client=api,
    )  # fmt: skip
    (post,) = server.calls("POST")
    env = {item["name"]: item.get("value") for item in post["body"]["spec"]["trainer"]["env"]}
    assert (env[RUN_ID_ENV], env[RUN_ROOT_ENV]) == (RUN, root)
    assert _steps(f"{root}/checkpoints/{RUN}/pretrain") == ["step-00000002", "step-00000004"]
    assert read_manifest(tmp_path / "model", verify=True)["metrics"]["world_size"] == 2
