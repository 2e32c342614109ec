"""run_training_stage: in process, torchrun in the pod (2 gloo ranks), and a multi-node job that really runs.

The job path runs against tests/fakes/k8s_api_server.py in execute mode: the created TrainJob's command runs as one
local process per node with the env Trainer would inject, its S3 credentials resolved from a Secret the server
holds, reading and writing the real SeaweedFS S3 server of tests/conftest.py.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import kubernetes
import pytest

import lmforge.launch.stage_runner as runner
from lmforge import storage
from lmforge.artifacts import read_manifest, write_manifest
from lmforge.config import LaunchConfig
from lmforge.errors import ArtifactIncompleteError, ConfigError, InputDataError
from lmforge.launch import (
    LaunchError,
    fetch_artifact,
    parse_launch,
    publish_artifact,
    read_result,
    run_training_stage,
    write_result,
)
from lmforge.preflight.preflight import PreflightError
from lmforge.results import StageResult
from lmforge.run_context import RUN_ID_ENV
from tests.fakes.k8s_api_server import K8sApiServer
from tests.support.token_shards import shards_of_another_tokenizer

OVERRIDES = {
    "model": {"arch": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 64},
    "train.max_steps": 4,
    "train.batch_size": 4,
    "train.seq_len": 32,
    "train.warmup_steps": 1,
    "train.eval_interval": 4,
    "train.eval_batches": 1,
    "train.log_interval": 2,
    "train.precision": "fp32",
}
RUN = "3f0d6a52-run"


def _io(shards: Path, tokenizer: Path, model: Path) -> dict[str, str]:
    return {"shards": str(shards), "tokenizer": str(tokenizer), "model": str(model)}


# --- configuration errors -------------------------------------------------------------------------------------------


def test_launch_json_with_an_unknown_field_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"launch\.num_node: Extra inputs are not permitted"):
        parse_launch('{"num_node": 2}')
    with pytest.raises(ConfigError, match=r"launch\.gpus_per_node: Input should be greater than or equal to 0"):
        parse_launch({"gpus_per_node": -1})
    with pytest.raises(ConfigError, match="launch: not valid JSON"):
        parse_launch("{num_nodes: 2}")
    with pytest.raises(ConfigError, match="launch: expected a JSON object"):
        parse_launch("[2]")


def test_pod_gpu_count_is_the_default_number_of_processes_unless_launch_sets_it():
    assert parse_launch("{}", gpus_per_node=4).gpus_per_node == 4
    assert parse_launch('{"gpus_per_node": 2}', gpus_per_node=4).gpus_per_node == 2
    assert parse_launch("", gpus_per_node=None).gpus_per_node == LaunchConfig().gpus_per_node
    assert parse_launch('{"s3_credentials.name": "team-s3"}').s3_credentials.name == "team-s3"


@pytest.mark.parametrize("staging", ["", "/shared/staging", "s3://", "gs://bucket/staging"])
def test_multi_node_without_an_s3_staging_uri_is_one_config_error(tmp_path, staging):
    io = _io(tmp_path / "shards", tmp_path / "tok", tmp_path / "model")
    with pytest.raises(ConfigError) as err:
        run_training_stage(
            "pretrain", LaunchConfig(num_nodes=2), io, preset="tiny-cpu", image="img", run_id=RUN, staging_uri=staging
        )
    assert str(err.value).startswith("staging_uri: launch.num_nodes=2 needs an s3://bucket/prefix")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("run_id", ["", "{{$.pipeline_job_uuid}}"])
def test_multi_node_without_a_resolved_run_id_is_refused(tmp_path, monkeypatch, run_id):
    monkeypatch.delenv(RUN_ID_ENV, raising=False)
    io = _io(tmp_path / "shards", tmp_path / "tok", tmp_path / "model")
    with pytest.raises(ConfigError, match=r"run id: .*LMFORGE_RUN_ID"):
        run_training_stage(
            "pretrain", LaunchConfig(num_nodes=2), io, preset="tiny-cpu", image="img", run_id=run_id,
            staging_uri="s3://bucket/staging",
        )  # fmt: skip


def test_a_bad_override_fails_before_anything_is_launched(tmp_path):
    io = _io(tmp_path / "shards", tmp_path / "tok", tmp_path / "model")
    with pytest.raises(ConfigError, match=r"pretrain\.train\.max_step"):
        run_training_stage(
            "pretrain", LaunchConfig(gpus_per_node=2), io, preset="tiny-cpu", overrides='{"train.max_step": 3}'
        )


def test_a_cluster_without_the_job_kind_fails_before_staging(tmp_path, tiny_shards_dir, tiny_tokenizer_dir):
    with K8sApiServer(served=("PyTorchJob",)) as server:
        api = _api(server)
        with pytest.raises(PreflightError, match=r"does not serve trainer\.kubeflow\.org/v1alpha1 .*Kubeflow Trainer"):
            run_training_stage(
                "pretrain", LaunchConfig(num_nodes=2), _io(tiny_shards_dir, tiny_tokenizer_dir, tmp_path / "m"),
                preset="tiny-cpu", image="img", run_id=RUN, staging_uri="s3://never-touched/staging", api_client=api,
            )  # fmt: skip
        assert server.calls("POST") == []


@pytest.mark.parametrize("stage", ["pretrain", "finetune_lora", "distill"])
def test_every_training_stage_runs_under_torchrun_or_as_a_job_as_the_launch_says(monkeypatch, stage):
    calls = []
    monkeypatch.setattr(runner, "_in_pod", lambda name, *args: calls.append(("torchrun", name)) or StageResult())
    monkeypatch.setattr(runner, "_as_job", lambda name, *args: calls.append(("job", name)) or StageResult())
    run_training_stage(stage, LaunchConfig(gpus_per_node=2), {}, preset="tiny-cpu")
    run_training_stage(stage, LaunchConfig(num_nodes=4, gpus_per_node=8), {}, preset="tiny-cpu")
    assert calls == [("torchrun", stage), ("job", stage)]


def test_a_stage_that_does_not_train_runs_here_with_a_warning_whatever_the_launch_says(monkeypatch, caplog):
    calls = []

    def fake_run_stage(name, cfg, paths, context=None):
        calls.append((name, paths))
        return StageResult(metrics={"max_abs_diff": 0.0})

    monkeypatch.setattr(runner, "run_stage", fake_run_stage)
    io = {"model": "/in/model", "onnx_model": "/out/onnx"}
    with caplog.at_level(logging.WARNING, logger="lmforge.launch"):
        result = run_training_stage("export_onnx", LaunchConfig(num_nodes=4, gpus_per_node=8), io, preset="tiny-cpu")

    assert calls == [("export_onnx", io)]
    assert result.summary["launch"] == {"mode": "in-process"}
    assert "export_onnx runs in one process" in caplog.text and "4 node(s) x 8 GPU(s)" in caplog.text


# --- the components: parse, call lmforge, publish ------------------------------------------------------------------


class _Artifact:
    """What a component body uses of a KFP artifact: path, metadata and (Metrics) log_metric."""

    def __init__(self, path: Path) -> None:
        self.path, self.metadata, self.logged = str(path), {}, {}

    def log_metric(self, name: str, value: float) -> None:
        self.logged[name] = value


def test_pretrain_component_runs_in_process_by_default_and_publishes(tmp_path, tiny_shards_dir, tiny_tokenizer_dir):
    from lmforge_kfp.components import load_component

    pretrain = load_component("pretrain")

    metrics, curves = _Artifact(tmp_path / "metrics"), _Artifact(tmp_path / "curves.html")
    pretrain.python_func(
        shards=_Artifact(tiny_shards_dir), tokenizer=_Artifact(tiny_tokenizer_dir), model=_Artifact(tmp_path / "m"),
        metrics=metrics, curves=curves, overrides=json.dumps(OVERRIDES),
    )  # fmt: skip
    assert metrics.logged["world_size"] == 1.0 and metrics.logged["steps"] == 4.0
    assert read_manifest(tmp_path / "m", verify=True)["kind"] == "model"
    assert "<img" in Path(curves.path).read_text()


@pytest.mark.parametrize(
    ("launch", "message"),
    [('{"nodes": 2}', r"launch\.nodes: Extra inputs"), ('{"num_nodes": 2}', r"staging_uri: launch\.num_nodes=2")],
)
def test_pretrain_component_refuses_a_bad_launch_before_training(tmp_path, capsys, launch, message):
    from lmforge_kfp.components import load_component

    pretrain = load_component("pretrain")

    with pytest.raises(SystemExit) as exited:
        pretrain.python_func(
            shards=_Artifact(tmp_path / "s"), tokenizer=_Artifact(tmp_path / "t"), model=_Artifact(tmp_path / "m"),
            metrics=_Artifact(tmp_path / "x"), curves=_Artifact(tmp_path / "c"), launch=launch,
        )  # fmt: skip
    assert exited.value.code == 2  # a config error: one error line, exit 2, no traceback
    assert re.search(message, capsys.readouterr().err.strip().splitlines()[-1])
    assert not (tmp_path / "m").exists()


# --- the result file and artifact copies ------------------------------------------------------------------------------


def test_result_round_trips_through_json(tmp_path):
    result = StageResult(metrics={"val_loss": 2.5}, html="<p>ok</p>", summary={"model_dir": "/x", "n": 3})
    write_result(result, str(tmp_path / "result.json"))
    assert read_result(str(tmp_path / "result.json")) == result
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(LaunchError, match="not a stage result"):
        read_result(str(tmp_path / "bad.json"))


def test_artifact_copies_refuse_incomplete_sources_and_never_overwrite(tmp_path, tiny_tokenizer_dir):
    remote = tmp_path / "remote" / "tokenizer"
    assert publish_artifact(tiny_tokenizer_dir, str(remote)) is True
    assert publish_artifact(tiny_tokenizer_dir, str(remote)) is False  # a retry: same artifact, nothing copied

    other = shutil.copytree(tiny_tokenizer_dir, tmp_path / "other")
    (other / "extra.txt").write_text("x")
    write_manifest(other, "tokenizer")
    with pytest.raises(InputDataError, match="already holds a different complete artifact"):
        publish_artifact(other, str(remote))
    (other / "manifest.json").unlink()
    with pytest.raises(ArtifactIncompleteError):
        publish_artifact(other, str(tmp_path / "remote" / "incomplete"))

    copy = tmp_path / "copy"
    fetch_artifact(str(remote), copy)
    assert read_manifest(copy, verify=True) == read_manifest(tiny_tokenizer_dir)
    (remote / "tokenizer.json").write_text("{}")  # a corrupted object: the copy is refused and left nowhere
    with pytest.raises(ArtifactIncompleteError, match="sha256 mismatch"):
        fetch_artifact(str(remote), tmp_path / "copy2")
    assert not (tmp_path / "copy2").exists()


# --- one pod, two processes: torchrun --standalone ---------------------------------------------------------------


@pytest.mark.slow
def test_two_gpus_per_node_run_torchrun_with_two_ranks_and_return_the_same_metrics(
    tmp_path, tiny_shards_dir, tiny_tokenizer_dir, caplog
):
    single = run_training_stage(
        "pretrain", LaunchConfig(gpus_per_node=1), _io(tiny_shards_dir, tiny_tokenizer_dir, tmp_path / "single"),
        preset="tiny-cpu", overrides=json.dumps(OVERRIDES),
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="lmforge.launch"):
        pair = run_training_stage(
            "pretrain", LaunchConfig(gpus_per_node=2), _io(tiny_shards_dir, tiny_tokenizer_dir, tmp_path / "pair"),
            preset="tiny-cpu", overrides=json.dumps(OVERRIDES),
        )  # fmt: skip

    assert single.summary["launch"] == {"mode": "in-process"}
    assert pair.summary["launch"] == {"mode": "torchrun", "nproc_per_node": 2}
    assert set(pair.metrics) == set(single.metrics)
    assert (single.metrics["world_size"], pair.metrics["world_size"]) == (1.0, 2.0)
    assert pair.summary["model_dir"] == str(tmp_path / "pair")
    assert "<img" in pair.html
    manifest = read_manifest(tmp_path / "pair", verify=True)
    assert manifest["kind"] == "model" and manifest["metrics"]["world_size"] == 2
    launched = next(r.getMessage() for r in caplog.records if "torchrun with 2 processes" in r.getMessage())
    assert "--standalone --nproc_per_node=2 -m lmforge stage pretrain" in launched
    assert any('"val_loss"' in r.getMessage() for r in caplog.records)  # the workers' output reached the log


@pytest.mark.slow
def test_a_failing_torchrun_raises_with_its_last_lines_and_writes_nothing(
    tmp_path, tiny_shards_dir, tiny_tokenizer_dir
):
    shards = shards_of_another_tokenizer(tiny_shards_dir, tmp_path / "other-shards")
    with pytest.raises(LaunchError) as err:
        run_training_stage(
            "pretrain", LaunchConfig(gpus_per_node=2, log_tail_lines=200),
            _io(shards, tiny_tokenizer_dir, tmp_path / "model"), preset="tiny-cpu", overrides=OVERRIDES,
        )  # fmt: skip
    message = str(err.value)
    assert message.startswith("pretrain: torchrun with 2 processes: exited with code 1")
    assert "use the tokenizer from the same tokenize run" in message
    assert not (tmp_path / "model").exists()


# --- several nodes: a TrainJob that runs for real --------------------------------------------------------------------


def _api(server: K8sApiServer) -> kubernetes.client.ApiClient:
    cfg = kubernetes.client.Configuration()
    cfg.host = server.url
    return kubernetes.client.ApiClient(cfg)


@pytest.fixture
def cluster(tmp_path, s3_server, s3_env):
    """The fake API server in execute mode; the S3 credentials exist only in its Secret ``lmforge-s3``."""
    creds = {k: v for k, v in s3_server.env().items() if k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    with K8sApiServer(
        max_lifetime_s=500,
        execute=True,
        workdir=tmp_path / "pods",
        secrets={"lmforge-s3": creds},
        base_env={"OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"},
    ) as server:
        yield server, _api(server), s3_env


def _job_config(s3_server, **kw) -> LaunchConfig:
    plain = {k: v for k, v in s3_server.env().items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    return LaunchConfig(
        num_nodes=2, gpus_per_node=0, namespace="lmforge", env=plain, watch_window_s=2, wait_timeout_s=400, **kw
    )


@pytest.mark.slow
@pytest.mark.s3
def test_two_node_trainjob_reads_staged_inputs_from_s3_and_its_outputs_come_back_verified(
    tmp_path, cluster, s3_server, tiny_shards_dir, tiny_tokenizer_dir
):
    server, api, bucket = cluster
    staging = f"s3://{bucket}/staging"
    out = tmp_path / "model"

    result = run_training_stage(
        "pretrain", _job_config(s3_server), _io(tiny_shards_dir, tiny_tokenizer_dir, out), preset="tiny-cpu",
        overrides=OVERRIDES, image="ghcr.io/lmforge/lmforge-train:test", run_id=RUN, staging_uri=staging,
        api_client=api,
    )  # fmt: skip

    prefix = f"{staging}/{RUN}/pretrain"
    # The job got only S3 URIs: nothing of this step's local paths.
    (post,) = server.calls("POST")
    command = post["body"]["spec"]["trainer"]["command"]
    io_args = dict(command[i + 1].split("=", 1) for i, arg in enumerate(command) if arg == "--io")
    assert io_args == {"model": f"{prefix}/model", "shards": f"{prefix}/shards", "tokenizer": f"{prefix}/tokenizer"}
    assert command[-2:] == ["--result", f"{prefix}/result.json"]
    assert str(tmp_path) not in json.dumps(post["body"])
    # ... and credentials only by reference; each pod got them from the Secret.
    assert s3_server.env()["AWS_SECRET_ACCESS_KEY"] not in json.dumps(post["body"])
    assert len(server.pod_envs) == 2
    assert all(
        env["AWS_SECRET_ACCESS_KEY"] == s3_server.env()["AWS_SECRET_ACCESS_KEY"] for env in server.pod_envs.values()
    )
    # Inputs were staged with their manifests, and each pod downloaded its own verified copy from S3.
    for name, local in (("shards", tiny_shards_dir), ("tokenizer", tiny_tokenizer_dir)):
        assert storage.read_bytes(f"{prefix}/{name}/manifest.json") == (local / "manifest.json").read_bytes()
    for pod_env in server.pod_envs.values():
        copies = list(Path(pod_env["TMPDIR"], "lmforge-inputs").glob("*/manifest.json"))
        assert sorted(json.loads(p.read_text())["kind"] for p in copies) == ["token-shards", "tokenizer"]
    # The output came back complete and verified, and its lineage names the S3 inputs the job read.
    manifest = read_manifest(out, verify=True)
    assert manifest["metrics"]["world_size"] == 2
    assert {k: v["uri"] for k, v in manifest["inputs"].items()} == {
        "shards": f"{prefix}/shards",
        "tokenizer": f"{prefix}/tokenizer",
    }
    assert (out / "model.safetensors").is_file()
    assert result.metrics["world_size"] == 2.0 and "val_loss" in result.metrics
    assert result.summary["model_dir"] == str(out)
    launch = result.summary["launch"]
    assert (launch["mode"], launch["kind"], launch["adopted"], launch["staging"]) == ("job", "TrainJob", False, prefix)


@pytest.mark.slow
@pytest.mark.s3
def test_a_failed_job_raises_with_its_log_lines_and_writes_no_local_output(
    tmp_path, cluster, s3_server, tiny_shards_dir, tiny_tokenizer_dir
):
    server, api, bucket = cluster
    shards = shards_of_another_tokenizer(tiny_shards_dir, tmp_path / "other-shards")
    out = tmp_path / "model"

    with pytest.raises(LaunchError) as err:
        run_training_stage(
            "pretrain", _job_config(s3_server, log_tail_lines=200), _io(shards, tiny_tokenizer_dir, out),
            preset="tiny-cpu", overrides=OVERRIDES, image="img", run_id=RUN, staging_uri=f"s3://{bucket}/staging",
            api_client=api,
        )  # fmt: skip

    message = str(err.value)
    assert message.startswith("TrainJob lmforge/lmf-pretrain-") and " failed: JobSetFailed: " in message
    assert "--- last " in message and "use the tokenizer from the same tokenize run" in message
    assert not out.exists()
    assert not storage.exists(f"s3://{bucket}/staging/{RUN}/pretrain/model")
    assert server.calls("DELETE") == []  # a failed job stays for inspection


def test_a_job_refuses_local_outputs_that_already_hold_something(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x.bin").write_bytes(b"x")
    (tmp_path / "file").write_bytes(b"x")
    outputs = {"model", "checkpoint"}
    runner.refuse_filled_outputs({"model": str(tmp_path / "empty"), "checkpoint": ""}, outputs)
    runner.refuse_filled_outputs({"model": str(tmp_path / "absent"), "shards": str(tmp_path / "full")}, outputs)
    for filled in ("full", "file"):
        with pytest.raises(InputDataError, match=f"output {tmp_path / filled} already exists and is not empty"):
            runner.refuse_filled_outputs({"model": str(tmp_path / filled)}, outputs)
