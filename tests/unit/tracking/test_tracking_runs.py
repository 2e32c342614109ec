"""MLflow tracking against a real ``mlflow server``: one parent run per pipeline run, one child per stage."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import pytest

from lmforge.artifacts import write_manifest
from lmforge.config import CheckpointConfig, EvaluateConfig, GateConfig, ModelConfig, PretrainConfig, TrainConfig
from lmforge.evaluate.gate import CHECKS, check_gate
from lmforge.results import StageResult
from lmforge.tracking import PipelineRun, Tracker, compare_runs, stage_run, track_stage
from lmforge.tracking.redact import flatten
from lmforge.tracking.runs import KFP_RUN_ID, PARENT_TAG
from lmforge.train import pretrain

pytestmark = pytest.mark.s3

STEPS = 6

MARKS = {"pass": "PASS", "fail": "FAIL", "n/a": "n/a", "off": "off"}  # how each status reads in a tag


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(uri, uri)


def _runs(uri: str, experiment: str, filter_string: str = "") -> list:
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id], filter_string, max_results=1000)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_shards_dir, tiny_tokenizer_dir) -> tuple[PretrainConfig, StageResult, Path]:
    """A real pretraining run of a few steps: its config, result and model directory (with training_history.json)."""
    cfg = PretrainConfig(
        model=ModelConfig(arch="gpt2", n_layer=2, n_head=2, n_embd=32, block_size=64),
        train=TrainConfig(
            max_steps=STEPS, batch_size=4, grad_accum=1, seq_len=32, lr=3e-3, min_lr=3e-4, warmup_steps=2,
            precision="fp32", eval_interval=3, eval_batches=1, log_interval=1, checkpoint=CheckpointConfig(),
        ),
    )  # fmt: skip
    out = tmp_path_factory.mktemp("pretrained") / "model"
    result = pretrain.run(cfg, shards=tiny_shards_dir, tokenizer=tiny_tokenizer_dir, model=out)
    return cfg, result, out


def _evaluation(root: Path) -> tuple[StageResult, Path]:
    """An evaluation output as ``evaluate`` writes it (report, results with the gate's real checks, manifest)."""
    results = {
        "models": {
            "student": {"perplexity": 250.0, "bits_per_byte": 2.5, "exact_match": 0.1},
            "onnx_fp32": {"perplexity": 250.0},
            "int8_dynamic": {"perplexity": 251.0, "p99_ms": 4.0},
        },
        "served_model": "int8_dynamic",
        "production": {"status": "none", "reason": "no release yet"},
    }
    decision = check_gate(GateConfig(), results)
    results |= {"gate": decision.to_dict(), "passed": decision.passed}
    root.mkdir(parents=True)
    report = "<html><body><h1>Evaluation</h1><p>student perplexity 250</p></body></html>"
    (root / "report.html").write_text(report, encoding="utf-8")
    (root / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    metrics = {"student_perplexity": 250.0, "student_bits_per_byte": 2.5, "passed": float(decision.passed)}
    write_manifest(root, "evaluation", metrics=metrics)
    result = StageResult(
        metrics=metrics, html=report, summary={"passed": decision.passed, "checks": results["gate"]["checks"]}
    )
    return result, root


def test_stages_of_one_pipeline_run_are_children_of_one_parent_found_by_the_kfp_run_id(
    tracking_env, mlflow_server, trained, tmp_path
):
    cfg, result, model_dir = trained
    run = PipelineRun("kfp-run-a", pipeline_version="0.1.0-abc123", preset="tiny-cpu")
    # Each stage runs in its own pod: a fresh tracker each, so the parent is found through the server.
    pre = Tracker().track_stage("pretrain", cfg, result, run=run, outputs={"model": model_dir})
    eval_result, eval_dir = _evaluation(tmp_path / "evaluation")
    ev = Tracker().track_stage("evaluate", EvaluateConfig(), eval_result, run=run, outputs={"evaluation": eval_dir})
    other = track_stage("pretrain", cfg, result, run_id="kfp-run-b", outputs={"model": model_dir})

    runs = _runs(mlflow_server.uri, tracking_env, f"tags.`{KFP_RUN_ID}` = 'kfp-run-a'")
    parents = [r for r in runs if PARENT_TAG not in r.data.tags]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.run_name == "lmforge-kfp-run-a"
    assert parent.data.tags["lmforge.preset"] == "tiny-cpu"
    assert parent.data.tags["lmforge.pipeline_version"] == "0.1.0-abc123"
    children = {r.info.run_id: r for r in runs if r.data.tags.get(PARENT_TAG) == parent.info.run_id}
    assert set(children) == {pre, ev}
    assert {r.data.tags["kfp.task_name"] for r in children.values()} == {"pretrain", "evaluate"}
    assert all(r.info.status == "FINISHED" for r in children.values())
    other_parent = _client(mlflow_server.uri).get_run(other).data.tags[PARENT_TAG]
    assert other_parent != parent.info.run_id
    # The parent holds every stage's final figures, prefixed, for the run comparison.
    assert parent.data.metrics["pretrain.val_loss"] == pytest.approx(result.metrics["val_loss"])
    assert parent.data.metrics["evaluate.student_perplexity"] == 250.0


def test_a_stage_run_has_its_config_as_params_and_every_training_step_as_metrics(tracking_env, mlflow_server, trained):
    cfg, result, model_dir = trained
    child = Tracker().track_stage("pretrain", cfg, result, run=PipelineRun("kfp-steps"), outputs={"model": model_dir})

    client = _client(mlflow_server.uri)
    data = client.get_run(child).data
    expected = flatten(cfg.model_dump(mode="json"))
    assert set(data.params) == set(expected)
    assert data.params["train.max_steps"] == str(STEPS)
    assert data.params["model.n_layer"] == "2"
    assert data.params["train.precision"] == "fp32"

    history = json.loads((model_dir / "training_history.json").read_text())
    assert len(history["step"]) == STEPS
    for name in ("train_loss", "lr", "grad_norm", "tokens_per_sec"):
        logged = sorted(client.get_metric_history(child, name), key=lambda m: m.step)
        assert [m.step for m in logged] == history["step"], name
        assert [m.value for m in logged] == pytest.approx(history[name]), name
    evals = sorted(client.get_metric_history(child, "eval_loss"), key=lambda m: m.step)
    assert [m.step for m in evals] == history["eval_step"]
    # Final figures: a name that is also a per-step series gets _final.
    assert data.metrics["val_loss"] == pytest.approx(result.metrics["val_loss"])
    assert data.metrics["train_loss_final"] == pytest.approx(result.metrics["train_loss"])
    assert {"model/manifest.json", "model/training_history.json"} <= _artifact_paths(client, child)


def _artifact_paths(client, run_id: str, path: str | None = None) -> set[str]:
    paths = set()
    for item in client.list_artifacts(run_id, path):
        paths |= _artifact_paths(client, run_id, item.path) if item.is_dir else {item.path}
    return paths


def test_evaluation_artifacts_download_equal_to_the_local_files_and_the_gate_checks_are_logged(
    tracking_env, mlflow_server, tmp_path
):
    result, eval_dir = _evaluation(tmp_path / "evaluation")
    child = track_stage("evaluate", EvaluateConfig(), result, run_id="kfp-eval", outputs={"evaluation": eval_dir})

    client = _client(mlflow_server.uri)
    assert _artifact_paths(client, child) == {
        f"evaluation/{n}" for n in ("report.html", "results.json", "manifest.json")
    }
    downloaded = Path(client.download_artifacts(child, "evaluation", str(tmp_path / "down")))
    for name in ("report.html", "results.json", "manifest.json"):
        assert (downloaded / name).read_bytes() == (eval_dir / name).read_bytes(), name

    data = client.get_run(child).data
    checks = result.summary["checks"]
    assert len(checks) == len(CHECKS)  # every check of the gate, each logged below
    for check in checks:
        assert data.metrics[f"gate.{check['name']}.passed"] == (1.0 if check["passed"] else 0.0)
        assert data.tags[f"gate.{check['name']}"] == f"{MARKS[check['status']]}: {check['reason']}"
        if check["value"] is not None and math.isfinite(check["value"]):
            assert data.metrics[f"gate.{check['name']}.value"] == pytest.approx(check["value"])
    assert data.tags["summary.passed"] == json.dumps(result.summary["passed"])


def test_the_html_report_of_a_stage_is_uploaded_when_no_output_holds_one(tracking_env, mlflow_server, tmp_path):
    html = "<html><body>loss curves</body></html>"
    child = track_stage("tokenize", {"vocab_size": 512}, StageResult(metrics={"tokens": 10.0}, html=html), run_id="k")

    client = _client(mlflow_server.uri)
    assert _artifact_paths(client, child) == {"report.html"}
    path = Path(client.download_artifacts(child, "report.html", str(tmp_path)))
    assert path.read_text(encoding="utf-8") == html


def test_a_stage_that_raises_leaves_a_failed_run_with_the_error(tracking_env, mlflow_server):
    with (
        pytest.raises(RuntimeError, match="disk full"),
        stage_run("clean", {"min_words": 5}, run_id="kfp-f") as tracked,
    ):
        raise RuntimeError("disk full")
    run = _client(mlflow_server.uri).get_run(tracked.run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["lmforge.error"] == "RuntimeError: disk full"


def test_under_kfp_mlflow_integration_the_stage_logs_into_the_task_run_kfp_made(
    tracking_env, mlflow_server, monkeypatch
):
    client = _client(mlflow_server.uri)
    experiment = client.create_experiment(f"{tracking_env}-kfp")
    # What KFP's API server and driver make (KEP-12862): a parent tagged with the run id, a nested run per task.
    kfp_parent = client.create_run(experiment, tags={KFP_RUN_ID: "kfp-native"}).info.run_id
    task = client.create_run(experiment, tags={PARENT_TAG: kfp_parent, "kfp.task_name": "evaluate"}).info.run_id
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", experiment)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME")
    monkeypatch.setenv("MLFLOW_RUN_ID", task)

    logged = track_stage(
        "evaluate", {"context": 64}, StageResult(metrics={"student_perplexity": 9.0}), run_id="kfp-native"
    )

    assert logged == task
    run = client.get_run(task)
    assert run.info.status == "RUNNING"  # KFP's launcher closes its own run
    assert run.data.params == {"context": "64"}
    assert run.data.tags["lmforge.stage"] == "evaluate"
    assert client.get_run(kfp_parent).data.metrics["evaluate.student_perplexity"] == 9.0
    assert len(client.search_runs([experiment])) == 2  # nothing of our own was created


def test_compare_runs_lists_the_last_pipeline_runs_newest_first_with_their_figures(
    tracking_env, mlflow_server, tmp_path
):
    for i, perplexity in enumerate((300.0, 200.0, 100.0)):
        result = StageResult(metrics={"student_perplexity": perplexity, "passed": 1.0})
        track_stage("evaluate", EvaluateConfig(), result, run_id=f"kfp-cmp-{i}", preset="tiny-cpu")

    rows = compare_runs(n=2)

    assert [r["kfp_run_id"] for r in rows] == ["kfp-cmp-2", "kfp-cmp-1"]
    assert [r["evaluate.student_perplexity"] for r in rows] == [100.0, 200.0]
    assert all(r["preset"] == "tiny-cpu" and r["status"] == "RUNNING" for r in rows)
    Tracker().end_pipeline_run(PipelineRun("kfp-cmp-2"))
    assert compare_runs(n=1)[0]["status"] == "FINISHED"
    assert list(rows[0])[:7] == ["run_id", "name", "kfp_run_id", "status", "started", "preset", "pipeline_version"]


def test_stages_starting_together_share_one_parent_run(tracking_env, mlflow_server):
    """clean_shard fans out: parallel stages of one pipeline run that all find no parent converge on one."""
    barrier = threading.Barrier(4)
    found: list[str | None] = []

    def stage(i: int) -> None:
        tracker = Tracker()  # one pod each
        barrier.wait()
        found.append(tracker.pipeline_run_id(PipelineRun("kfp-fan-out")))

    threads = [threading.Thread(target=stage, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)

    runs = _runs(mlflow_server.uri, tracking_env, f"tags.`{KFP_RUN_ID}` = 'kfp-fan-out'")
    assert len(runs) == 1  # duplicates made in the race were deleted
    assert found == [runs[0].info.run_id] * 4


def test_config_keys_mlflow_would_refuse_are_made_valid(tracking_env, mlflow_server):
    child = track_stage("clean", {"rules": {"url:ratio": 0.5, "ok": 1}}, StageResult(), run_id="kfp-keys")
    assert _client(mlflow_server.uri).get_run(child).data.params == {"rules.url_ratio": "0.5", "rules.ok": "1"}
