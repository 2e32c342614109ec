"""Every stage run through the registry is tracked: run_stage opens its MLflow run, promote registers the release.

Against a real ``mlflow server`` (tests/support/mlflow_server.py) and, for releases, the SeaweedFS S3 test server.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lmforge import storage
from lmforge.artifacts import write_manifest
from lmforge.cli import application
from lmforge.config import CheckpointConfig, ModelConfig, PretrainConfig, TrainConfig
from lmforge.errors import ConfigError, GateBaselineMovedError, InputDataError, TrackingError
from lmforge.release.catalog import production_baseline, production_fingerprint, production_summary
from lmforge.results import StageResult
from lmforge.stages import StageSpec, artifact, register, resolve_stage_config, run_stage, unregister
from lmforge.tracking import PipelineRun, Tracker
from lmforge.tracking.compare import side_by_side
from lmforge.tracking.runs import KFP_RUN_ID, PARENT_TAG
from tests.support.mlflow_server import MlflowServer

pytestmark = pytest.mark.s3


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(uri, uri)


def _pipeline(uri: str, experiment: str, run_id: str) -> tuple[object, dict[str, object]]:
    """The parent run of pipeline run ``run_id`` and its children by stage."""
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], f"tags.`{KFP_RUN_ID}` = '{run_id}'", max_results=100)
    (parent,) = [r for r in runs if PARENT_TAG not in r.data.tags]
    children = {r.data.tags["lmforge.stage"]: r for r in runs if r.data.tags.get(PARENT_TAG) == parent.info.run_id}
    return parent, children


@pytest.fixture
def corpus(tmp_path, shakespeare_docs) -> Path:
    path = tmp_path / "raw.jsonl"
    path.write_text("".join(json.dumps(doc) + "\n" for doc in shakespeare_docs[:3]))
    return path


def test_a_stage_run_through_the_registry_is_a_child_of_its_pipeline_run_with_config_and_inputs_as_params(
    tracking_env, mlflow_server, corpus, tmp_path
):
    context = {"run_id": "kfp-stages-1", "preset": "tiny-cpu", "pipeline_version": "0.1.0-feedbeef0001"}
    cfg = resolve_stage_config("clean", "tiny-cpu", {"language.enabled": False})
    result = run_stage("clean", cfg, {"corpus_uri": str(corpus), "cleaned": str(tmp_path / "cleaned")}, context=context)
    run_stage("plan_shards", None, {"shard_count": "2"}, context=context)  # a stage without config, same run

    parent, children = _pipeline(mlflow_server.uri, tracking_env, "kfp-stages-1")
    assert set(children) == {"clean", "plan_shards"}
    assert parent.info.status == "RUNNING"  # neither is the pipeline's last step
    assert parent.data.tags["lmforge.preset"] == "tiny-cpu"
    assert parent.data.tags["lmforge.pipeline_version"] == "0.1.0-feedbeef0001"
    clean = children["clean"]
    assert clean.info.status == "FINISHED"
    assert clean.data.params["min_words"] == str(cfg.min_words)
    assert clean.data.params["language.enabled"] == "false"  # as JSON
    assert clean.data.params["input.corpus_uri"] == str(corpus)
    for name, value in result.metrics.items():
        assert clean.data.metrics[name] == pytest.approx(value), name
    artifacts = {a.path for a in _client(mlflow_server.uri).list_artifacts(clean.info.run_id, "cleaned")}
    assert "cleaned/manifest.json" in artifacts
    assert children["plan_shards"].data.params == {"input.shard_count": "2"}


def test_a_stage_that_fails_is_failed_in_mlflow_with_its_error_and_so_is_its_pipeline_run(
    tracking_env, mlflow_server, tmp_path
):
    context = {"run_id": "kfp-stages-failing", "preset": "tiny-cpu"}
    cfg = resolve_stage_config("clean", "tiny-cpu")
    with pytest.raises(InputDataError):
        run_stage(
            "clean", cfg, {"corpus_uri": str(tmp_path / "absent.jsonl"), "cleaned": str(tmp_path)}, context=context
        )

    parent, children = _pipeline(mlflow_server.uri, tracking_env, "kfp-stages-failing")
    assert children["clean"].info.status == "FAILED"
    assert "absent.jsonl" in children["clean"].data.tags["lmforge.error"]
    assert parent.info.status == "FAILED"


def test_without_a_tracking_uri_run_stage_imports_nothing_from_mlflow(tmp_path):
    script = (
        "import json, sys\n"
        "from lmforge.stages import run_stage\n"
        "result = run_stage('plan_shards', None, {'shard_count': 3}, context={'run_id': 'kfp-off'})\n"
        "print(json.dumps({'indices': result.summary['shard_indices'],"
        " 'mlflow': any(m.split('.')[0] == 'mlflow' for m in sys.modules)}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"indices": [0, 1, 2], "mlflow": False}
    assert "WARNING" not in done.stderr


# --- the server goes away while a stage trains -----------------------------------------------------------------------

_SERVER: list[MlflowServer] = []


def pretrain_after_the_server_stops(cfg: PretrainConfig, *, shards: str, tokenizer: str, model: str) -> StageResult:
    """The real pretrain stage, entered after its MLflow run was created; the tracking server stops first."""
    from lmforge.train import pretrain

    _SERVER[0].stop()
    return pretrain.run(cfg, shards=shards, tokenizer=tokenizer, model=model)


STOPPING = StageSpec(
    name="pretrain_stopping",
    summary="pretrain, with the tracking server stopped once the stage's MLflow run exists (a test stage).",
    entry=f"{__name__}:pretrain_after_the_server_stops",
    config=PretrainConfig,
    section="pretrain",
    inputs=(artifact("shards", "Dataset", "Token shards."), artifact("tokenizer", "Artifact", "Tokenizer.")),
    outputs=(artifact("model", "Model", "The model."),),
)


@pytest.mark.slow
def test_with_the_server_stopped_mid_stage_training_completes_and_one_warning_names_the_uri(
    mlflow_executable, tiny_shards_dir, tiny_tokenizer_dir, tmp_path, monkeypatch, caplog
):
    cfg = PretrainConfig(
        model=ModelConfig(arch="gpt2", n_layer=1, n_head=2, n_embd=32, block_size=32),
        train=TrainConfig(
            max_steps=4, batch_size=2, grad_accum=1, seq_len=32, warmup_steps=1, precision="fp32", eval_interval=2,
            eval_batches=1, log_interval=1, checkpoint=CheckpointConfig(),
        ),
    )  # fmt: skip
    with MlflowServer(tmp_path / "server", mlflow_executable) as server:
        _SERVER[:] = [server]
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
        monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "stopped-mid-stage")
        register(STOPPING)
        try:
            with caplog.at_level(logging.WARNING, logger="lmforge.tracking"):
                io = {
                    "shards": str(tiny_shards_dir),
                    "tokenizer": str(tiny_tokenizer_dir),
                    "model": str(tmp_path / "m"),
                }
                result = run_stage("pretrain_stopping", cfg, io, context={"run_id": "kfp-stopped"})
        finally:
            unregister(STOPPING.name)
    assert result.metrics["steps"] == 4 and (tmp_path / "m" / "manifest.json").is_file()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "lmforge.tracking"]
    assert len(warnings) == 1, warnings
    assert server.uri in warnings[0]


# --- promote: the release as a model version, the production alias ----------------------------------------------------


def _artifact(root: Path, kind: str, files: dict[str, str]) -> str:
    root.mkdir(parents=True)
    for name, text in files.items():
        (root / name).write_text(text)
    write_manifest(root, kind)
    return str(root)


def _promote_io(root: Path, release_root: str, model: str, version: str, production: dict) -> dict[str, str]:
    """Everything promote takes: artifacts with their own weights, and an evaluation gated against ``production``."""
    check = {"name": "student_perplexity", "value": 80.0, "threshold": 1e4, "passed": True, "reason": "below"}
    evaluation = root / "evaluation"
    evaluation.mkdir(parents=True)
    (evaluation / "results.json").write_text(
        json.dumps({"passed": True, "gate": {"passed": True, "checks": [check]}, "production": production})
    )
    (evaluation / "report.html").write_text("<html>report</html>")
    write_manifest(evaluation, "evaluation", metrics={"student_bits_per_byte": 1.5, "passed": 1.0})
    return {
        "student": _artifact(root / "student", "model", {"config.json": json.dumps({"version": version})}),
        "onnx_fp32": _artifact(root / "onnx", "onnx-model", {"model.onnx": version}),
        "int8_dynamic": _artifact(root / "dyn", "onnx-model", {"model.onnx": version}),
        "int8_qdq": _artifact(root / "qdq", "onnx-model", {"model.onnx": version}),
        "engine": _artifact(root / "engine", "tensorrt-engine", {"status.json": '{"status": "skipped"}'}),
        "evaluation": str(evaluation),
        "release_root": release_root,
        "model_name": model,
        "version": version,
    }


def _alias(uri: str, model: str) -> str | None:
    return _client(uri).get_registered_model(model).aliases.get("production")


def test_promote_registers_the_release_moves_the_alias_records_the_run_and_ends_the_pipeline_run(
    tracking_env, mlflow_server, s3_env, tmp_path
):
    model, root = f"lm-{uuid.uuid4().hex[:8]}", f"s3://{s3_env}/releases"
    io = _promote_io(tmp_path / "v1", root, model, "v1", production_summary(root, model))
    context = {"run_id": "kfp-promote-1", "preset": "tiny-cpu"}
    run_stage("plan_shards", None, {"shard_count": 1}, context=context)  # an earlier step of the same run
    result = run_stage("promote", None, io, context=context)

    summary = result.summary
    assert summary["status"] == "published" and summary["alias_moved"] is True
    version = _client(mlflow_server.uri).get_model_version(model, summary["model_version"])
    assert version.source == summary["release_uri"] == f"{root}/models/{model}/v1"
    assert _alias(mlflow_server.uri, model) == summary["model_version"] == summary["alias_version"]
    manifest = json.loads(storage.read_bytes(summary["manifest_uri"]))
    assert manifest["run_id"] == "kfp-promote-1"  # the stage's context reaches the release's lineage
    parent, children = _pipeline(mlflow_server.uri, tracking_env, "kfp-promote-1")
    assert version.run_id == parent.info.run_id  # the version links to the pipeline run that made it
    assert set(children) == {"plan_shards", "promote"}
    assert children["promote"].data.tags["summary.alias_moved"] == "true"
    assert parent.info.status == "FINISHED"  # promote is the pipeline's last step


def test_a_release_under_a_local_root_is_published_but_not_registered_with_one_warning(
    tracking_env, mlflow_server, tmp_path, caplog
):
    model = f"lm-{uuid.uuid4().hex[:8]}"
    io = _promote_io(tmp_path / "in", str(tmp_path / "releases"), model, "v1", {"status": "none", "reason": "first"})
    with caplog.at_level(logging.WARNING, logger="lmforge.tracking"):
        result = run_stage("promote", None, io, context={"run_id": "kfp-local-release"})
    assert result.summary["status"] == "published" and "model_version" not in result.summary
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "local path" in warning and "not registered" in warning
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException):
        _client(mlflow_server.uri).get_registered_model(model)


def test_with_production_source_mlflow_the_alias_is_the_baseline_a_moved_alias_stops_promote_and_a_rollback_counts(
    tracking_env, mlflow_server, s3_env, tmp_path
):
    model, root = f"lm-{uuid.uuid4().hex[:8]}", f"s3://{s3_env}/releases"
    first = run_stage("promote", None, _promote_io(tmp_path / "v1", root, model, "v1", production_summary(root, model)))
    baseline = production_baseline(root, model, "mlflow")
    assert baseline["status"] == "found" and baseline["source"] == "mlflow" and baseline["version"] == "v1"
    assert baseline["fingerprint"] == production_summary(root, model)["fingerprint"]  # the same release, either way
    before = production_fingerprint(root, model, "mlflow")

    # Two candidates gated against v1 through the alias; the first one promoted moves it, so the second is stale.
    stale = _promote_io(tmp_path / "v2", root, model, "v2", baseline)
    run_stage("promote", None, _promote_io(tmp_path / "v3", root, model, "v3", baseline))
    assert production_fingerprint(root, model, "mlflow") != before  # preflight's cache key follows the alias
    with pytest.raises(GateBaselineMovedError, match="alias"):
        run_stage("promote", None, stale)
    assert not storage.exists(f"{root}/models/{model}/v2/manifest.json")  # refused before anything was published

    # Roll back in MLflow: the alias names v1 again, and a run gated against it promotes, though latest.json is v3.
    _client(mlflow_server.uri).set_registered_model_alias(model, "production", first.summary["model_version"])
    rolled_back = production_baseline(root, model, "mlflow")
    assert rolled_back["version"] == "v1"
    result = run_stage("promote", None, _promote_io(tmp_path / "v4", root, model, "v4", rolled_back))
    assert result.summary["alias_moved"] is True
    assert _alias(mlflow_server.uri, model) == result.summary["model_version"]


def test_switching_to_production_source_mlflow_promotes_against_an_alias_that_names_nothing_yet(
    tracking_env, mlflow_server, s3_env, tmp_path, monkeypatch
):
    model, root = f"lm-{uuid.uuid4().hex[:8]}", f"s3://{s3_env}/releases"
    with monkeypatch.context() as untracked:  # a release made before the team tracked anything
        untracked.delenv("MLFLOW_TRACKING_URI")
        run_stage("promote", None, _promote_io(tmp_path / "v1", root, model, "v1", production_summary(root, model)))
    baseline = production_baseline(root, model, "mlflow")
    assert baseline["status"] == "none" and baseline["source"] == "mlflow"
    result = run_stage("promote", None, _promote_io(tmp_path / "v2", root, model, "v2", baseline))
    assert result.summary["status"] == "published" and result.summary["alias_moved"] is True
    assert json.loads(storage.read_bytes(f"{root}/models/{model}/latest.json"))["version"] == "v2"


def test_production_source_mlflow_without_tracking_or_with_a_local_root_fails_before_publishing(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(TrackingError, match="MLFLOW_TRACKING_URI"):
        production_baseline(None, "lm", "mlflow")
    baseline = {"status": "found", "version": "v1", "fingerprint": "f", "source": "mlflow"}
    io = _promote_io(tmp_path / "in", str(tmp_path / "releases"), "lm", "v2", baseline)
    with pytest.raises(ConfigError, match="s3:// release root"):
        run_stage("promote", None, io)
    assert not (tmp_path / "releases").exists()


# --- comparing runs ---------------------------------------------------------------------------------------------------


def test_side_by_side_shows_the_key_figures_and_only_the_other_figures_that_differ():
    rows = [
        {"run_id": "a", "name": "lmforge-1", "evaluate.student_perplexity": 40.0, "clean.docs_out": 9.0, "x.same": 1.0},
        {"run_id": "b", "name": "lmforge-2", "evaluate.student_perplexity": 55.5, "clean.docs_out": 7.0, "x.same": 1.0},
    ]
    lines = dict(side_by_side(rows))
    assert lines["name"] == ["lmforge-1", "lmforge-2"]
    assert lines["evaluate.student_perplexity"] == ["40", "55.5"]
    assert lines["clean.docs_out"] == ["9", "7"]
    assert "x.same" not in lines and "run_id" not in lines


def test_lmforge_runs_mlflow_prints_the_last_runs_figures_side_by_side(tracking_env, mlflow_server):
    for run_id, perplexity in (("kfp-cmp-1", 40.0), ("kfp-cmp-2", 55.5), ("kfp-cmp-3", 61.0)):
        figures = StageResult(metrics={"student_perplexity": perplexity, "passed": 1.0})
        Tracker().track_stage("evaluate", {}, figures, run=PipelineRun(run_id, preset="tiny-cpu"))
    result = CliRunner().invoke(
        application(), ["runs", "--mlflow", "--experiment", tracking_env, "--limit", "2"], terminal_width=200
    )
    assert result.exit_code == 0, result.output
    assert "kfp-cmp-3" in result.output and "kfp-cmp-2" in result.output and "kfp-cmp-1" not in result.output
    line = next(line for line in result.output.splitlines() if "evaluate.student_perplexity" in line)
    assert line.index("61") < line.index("55.5")  # newest first


def test_lmforge_runs_without_host_or_mlflow_says_what_to_pass():
    result = CliRunner().invoke(application(), ["runs"])
    assert result.exit_code == 2
    assert "--host" in result.output and "--mlflow" in result.output
