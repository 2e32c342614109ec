"""End to end: the compiled DAG runs under kfp.local and leaves every artifact a user expects.

With an MLflow server available (tests/support/mlflow_server.py) the two runs here are tracked, releasing into the S3
test server (MLflow's registry takes only remote releases): the tests at the end check what MLflow holds of them.
"""

from __future__ import annotations

import io
import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmforge import storage
from lmforge.artifacts import MANIFEST, is_run_record, read_manifest
from lmforge.evaluate.report import MODEL_LABELS
from lmforge.onnx_runtime import NO_PAST_FILE
from lmforge.release.catalog import CLAIM

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # ~2 min on an idle 2-core machine

SMALL = {
    "tokenize_overrides": {"vocab_size": 512},
    "pretrain_overrides": {
        "model.n_layer": 2,
        "model.n_embd": 64,
        "model.block_size": 64,
        "train.max_steps": 30,
        "train.warmup_steps": 5,
        "train.seq_len": 64,
        "train.batch_size": 8,
        "train.eval_interval": 15,
    },
    "finetune_lora_overrides": {"train.max_steps": 10, "train.warmup_steps": 2, "train.seq_len": 64},
    "distill_overrides": {"train.max_steps": 15, "train.warmup_steps": 2, "train.seq_len": 64, "train.batch_size": 8},
    "quantize_int8_overrides": {"calibration_sequences": 8, "calibration_seq_len": 32},
    # A 15-step student of a 30-step base answers nothing: the tiny-cpu gate's checks against the teacher and the
    # base would stop it. They have their own tests (test_evaluate_broken_student.py); here the subject
    # is the DAG and the comparison with production, so they are off.
    "evaluate_overrides": {
        "context": 64,
        "max_eval_tokens": 2048,
        "latency_runs": 3,
        "harness.limit": 8,  # the packaged tasks on 8 documents each: the DAG's wiring is the subject here
        "gate.max_empty_answers": None,
        "gate.max_answer_loss_increase": None,
        "gate.max_f1_drop": None,
        "gate.max_teacher_forgetting": None,
        "gate.max_student_forgetting": None,
    },
    "serve_overrides": {"apply": True},  # asked to apply, yet kfp.local has no cluster: skipped, and says why
}


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory, shakespeare_docs) -> Path:
    """40 scenes, then 3 exact copies (case and spacing changed) and 3 near copies (3 words changed) of some of
    them, which the dedup removes: the cleaned corpus is the 40 scenes' whatever the dedup settings."""
    scenes = shakespeare_docs[:40]
    copies = [{"id": f"exact-{i}", "text": "  " + scenes[i]["text"].upper().replace(" ", "  ")} for i in (3, 11, 25)]
    for i in (5, 17, 30):
        words = scenes[i]["text"].split(" ")
        words[10] = words[len(words) // 2] = words[-10] = "forsooth"
        copies.append({"id": f"near-{i}", "text": " ".join(words)})
    path = tmp_path_factory.mktemp("corpus") / "scenes.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for doc in scenes + copies:
            fh.write(json.dumps(doc) + "\n")
    return path


@pytest.fixture(scope="module")
def tracking(request, tmp_path_factory):
    """MLflow tracking for this module's runs, when a server can run here; else ``None`` (the runs go untracked).

    Yields ``(server, experiment, release_root)``: the release root is a bucket on the S3 test server then.
    """
    try:
        server = request.getfixturevalue("mlflow_server")
    except pytest.skip.Exception:
        yield None
        return
    import boto3

    s3 = request.getfixturevalue("s3_server")
    bucket, experiment = f"e2e-{uuid.uuid4().hex[:10]}", f"e2e-{uuid.uuid4().hex[:10]}"
    with pytest.MonkeyPatch.context() as env:
        for key, value in {**s3.env(), "MLFLOW_TRACKING_URI": server.uri, "MLFLOW_EXPERIMENT_NAME": experiment}.items():
            env.setenv(key, value)  # the kfp.local tasks inherit them
        storage.s3_client.cache_clear()
        boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        yield server, experiment, f"s3://{bucket}/releases"
    storage.s3_client.cache_clear()


# The first run cleans in 2 shards and dedups in 3 band groups × 2 parts: the partitioned dedup's fan-outs run.
FAN_OUT = {"clean_shards": 2, "dedup_band_groups": 3, "dedup_parts": 2}
NO_FAN_OUT = {"clean_shards": 1, "dedup_band_groups": 1, "dedup_parts": 1}


def _run_demo(
    corpus: Path, root: str, version: str, workdir: Path, fan_out: dict[str, int] = FAN_OUT, **kwargs: Any
) -> Any:
    """The DAG on ``corpus`` with :data:`SMALL`'s settings, releasing ``version`` under ``root``, without a cluster."""
    from lmforge_kfp.pipelines.local_run import run_pipeline_locally

    params = {
        "corpus_uri": str(corpus),
        "qa_uri": "demo://chatterbot",
        "release_root": root,
        "release_version": version,
        **fan_out,
        **{k: json.dumps(v) for k, v in SMALL.items()},
    }
    with pytest.MonkeyPatch.context() as env:  # no cluster for serve's apply, whatever kubeconfig this machine has
        env.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        env.setenv("KUBECONFIG", str(workdir / "no-kubeconfig"))
        return run_pipeline_locally(params, workdir / "runs", **kwargs)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, small_corpus, tracking):
    out = tmp_path_factory.mktemp("e2e")
    root = tracking[2] if tracking else str(out / "registry")
    shown = io.StringIO()
    run = _run_demo(small_corpus, root, "v-test", out, console="default", out=shown)
    (run.logs / "console.txt").write_text(shown.getvalue(), encoding="utf-8")  # what `lmforge run` showed
    return run, root


@pytest.fixture(scope="module")
def rerun(local_run, small_corpus, tmp_path_factory):
    """The first run again, on the same inputs into the same registry (as a schedule would), asking for v-again;
    cleaned in one shard without the dedup fan-outs, which the docs say give the same corpus for any count.
    Untracked: what it is checked for is in the release root, and every stage importing MLflow would only add time."""
    _, root = local_run
    with pytest.MonkeyPatch.context() as env:
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
        return _run_demo(small_corpus, root, "v-again", tmp_path_factory.mktemp("e2e-again"), NO_FAN_OUT)


def _release(root: str, *parts: str) -> str:
    return storage.join(root, "models", "scenes", *parts)


ARTIFACTS = [
    ("dedup-union", "plan", "dedup-plan"),
    ("merge-shards", "cleaned", "cleaned-corpus"),
    ("tokenize", "tokenizer", "tokenizer"),
    ("tokenize", "shards", "token-shards"),
    ("pretrain", "model", "model"),
    ("finetune-lora", "adapter", None),
    ("finetune-lora", "merged_model", "model"),
    ("distill", "student", "model"),
    ("export-onnx", "onnx_model", "onnx-model"),
    ("quantize-int8", "int8_dynamic", "onnx-model"),
    ("quantize-int8", "int8_qdq", "onnx-model"),
    ("build-tensorrt", "engine", "tensorrt-engine"),
    ("evaluate", "evaluation", "evaluation"),
    ("serve", "serving", "serving"),
]


@pytest.mark.parametrize(("task", "name", "kind"), ARTIFACTS, ids=lambda x: str(x))
def test_every_stage_leaves_a_complete_artifact(local_run, task, name, kind):
    run, _ = local_run
    manifest = read_manifest(run.output(task, name), verify=True)
    if kind:
        assert manifest["kind"] == kind


def test_report_and_gate_and_release(local_run, tmp_path):
    run, root = local_run
    evaluation = run.output("evaluate", "evaluation")
    html = (evaluation / "report.html").read_text(encoding="utf-8")
    assert "<img" in html and "perplexity" in html.lower()
    results = json.loads((evaluation / "results.json").read_text())
    for model in ("base", "teacher", "student", "onnx_fp32", "int8_dynamic"):
        assert np.isfinite(results["models"][model]["perplexity"]), model
    assert results["models"]["base"]["uri"] == str(run.output("pretrain", "model"))  # evaluate got pretrain's model
    assert results["headline"]["teacher_bits_per_byte_vs_base"] > 0
    served = results["served_model"]  # it answered the held-out prompts itself, through its KV-cache decoder
    assert results["models"][served]["generation"]["prompts"] > 0
    assert results["headline"]["empty_answer_model"] == served
    assert results["passed"] is True
    assert run.promoted
    manifest = json.loads(storage.read_bytes(_release(root, "v-test", MANIFEST)))
    assert manifest["version"] == "v-test" and manifest["run_id"] == run.run_dir.parent.name
    # the release's model card parses and carries the report's harness numbers
    from huggingface_hub import ModelCard

    card = ModelCard.load(storage.localize(_release(root, "v-test", "student", "README.md"), tmp_path / "card"))
    numbers = {
        (e["dataset"]["type"], m["type"]): m["value"]
        for e in card.data.to_dict()["model-index"][0]["results"]
        for m in e["metrics"]
    }
    status = json.loads((run.output("build-tensorrt", "engine") / "status.json").read_text())
    assert status["status"] == "skipped" and status["reason"]
    # the packaged harness tasks ran on base, teacher and student (items longer than the 64-token context left
    # out and counted), and the report and the card show their numbers
    harness = results["harness"]
    assert harness["status"] == "evaluated" and harness["errors"] == {}, harness.get("errors")
    report_md = (evaluation / "report.md").read_text(encoding="utf-8").split("## Standard evaluations")[1]
    for model in ("base", "teacher", "student"):
        row = next(line for line in report_md.splitlines() if line.startswith(f"| {MODEL_LABELS[model]} |"))
        for task in ("lmforge_qa_mc", "lmforge_cloze"):
            lost = harness["skipped"].get(model, {}).get(task, {"skipped": 0})
            assert harness["tasks"][task]["documents"] == 8 and lost["skipped"] < 8, (model, task, lost)
            acc = harness["scores"][model][task]["acc"]
            assert 0 <= acc <= 1 and f"{acc:.4g}" in row, (model, task, row)
    for task, scores in harness["scores"]["student"].items():
        assert numbers[(task, "acc")] == scores["acc"]


def test_the_report_sets_preflights_plan_against_what_each_stage_measured_on_this_cpu(local_run):
    run, _ = local_run
    evaluation = run.output("evaluate", "evaluation")
    compared = json.loads((evaluation / "results.json").read_text())["plan_vs_actual"]
    rows = {(row["stage"], row["figure"]): row for row in compared["rows"]}
    assert {stage for stage, _ in rows} == {"pretrain", "finetune_lora", "distill"}
    for stage in ("pretrain", "finetune_lora", "distill"):
        assert rows[stage, "tokens"]["actual"] > 0 and rows[stage, "hours"]["actual"] > 0, stage
        assert rows[stage, "MFU"]["planned"] == 0.4 and rows[stage, "MFU"]["actual"] is None, stage  # no CPU peak
    assert set(compared["mfu_sources"].values()) == {"assumed"}
    assert "No stage measured MFU" in compared["note"]
    assert "## Plan against actual" in (evaluation / "report.md").read_text(encoding="utf-8")


def test_serve_writes_the_inference_service_of_the_release_and_skips_the_apply_without_a_cluster(local_run):
    from lmforge_kfp.commands import _serve_hint
    from lmforge_kfp.components.images import service_image

    run, root = local_run
    release = _release(root, "v-test")  # local, or on the S3 test server when the runs are tracked
    serving = run.output("serve", "serving")
    artifacts = json.loads(storage.read_bytes(storage.join(release, MANIFEST)))["artifacts"]
    served = "int8_dynamic" if "int8_dynamic" in artifacts else "onnx_fp32"
    isvc = yaml.safe_load((serving / "inferenceservice.yaml").read_text())
    assert (isvc["kind"], isvc["metadata"]["name"]) == ("InferenceService", "scenes")
    assert isvc["spec"]["predictor"]["model"]["storageUri"] == storage.join(release, served)
    runtime = yaml.safe_load((serving / "servingruntime.yaml").read_text())
    assert runtime["spec"]["containers"][0]["image"] == service_image("serve")  # the image the pipeline builds
    status = json.loads((serving / "status.json").read_text())
    assert (status["status"], status["reason"], status["written"]) == ("skipped", "no cluster", [])
    assert _serve_hint(run) == f"serve it: lmforge serve {release} --port 8080"  # the demo summary's last line


def test_the_serve_command_of_the_summary_serves_the_new_release(local_run, tmp_path):
    from tests.support.serve_helpers import serving

    run, _ = local_run
    command = json.loads((run.output("serve", "serving") / "status.json").read_text())["local_command"].split()
    assert command[:2] == ["lmforge", "serve"] and command[3:] == ["--port", "8080"]
    limits = {"max_tokens_limit": 4, "default_max_tokens": 4}
    release = command[2] if command[2].startswith("s3://") else Path(command[2])
    with serving(release, tmp_path / "serve.log", limits, cli=True) as server:  # on a free port, not 8080
        body = {"model": "scenes", "prompt": "ROMEO:", "max_tokens": 4}
        resp = httpx.post(f"{server.url}/openai/v1/completions", json=body, timeout=60)
        too_many = httpx.post(f"{server.url}/openai/v1/completions", json={**body, "max_tokens": 5}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] <= 4 and isinstance(resp.json()["choices"][0]["text"], str)
    assert too_many.status_code == 400 and "max_tokens" in too_many.text  # --set serve.max_tokens_limit=4 applied


@pytest.mark.parametrize(
    ("task", "name"), [("pretrain", "model"), ("finetune-lora", "merged_model"), ("distill", "student")]
)
def test_models_load_with_transformers_and_generate(local_run, task, name):
    run, _ = local_run
    path = run.output(task, name)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("ROMEO: ", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids["input_ids"].shape[1]


def test_adapter_loads_with_peft(local_run):
    from peft import PeftModel

    run, _ = local_run
    base = AutoModelForCausalLM.from_pretrained(run.output("pretrain", "model"))
    tuned = PeftModel.from_pretrained(base, run.output("finetune-lora", "adapter"))
    assert any("lora_" in name for name, _ in tuned.named_parameters())


@pytest.mark.parametrize(
    ("task", "name"), [("export-onnx", "onnx_model"), ("quantize-int8", "int8_dynamic"), ("quantize-int8", "int8_qdq")]
)
def test_onnx_models_load_in_onnxruntime(local_run, task, name):
    run, _ = local_run
    session = ort.InferenceSession(str(run.output(task, name) / NO_PAST_FILE), providers=["CPUExecutionProvider"])
    ids = np.array([[1, 2, 3, 4]], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(4)[None]}
    (logits,) = session.run(["logits"], feeds)
    assert logits.shape[:2] == (1, 4) and np.isfinite(logits).all()


def test_a_rerun_on_unchanged_inputs_returns_the_release_it_made_and_publishes_no_copy(local_run, rerun):
    """Cleaning (in any number of shards), training, export and quantization are deterministic, so the second run
    makes the same model files; only run records (timings, event logs) differ, and promote returns the existing
    release instead of publishing v-again."""
    run, root = local_run
    for task, name in [("distill", "student"), ("export-onnx", "onnx_model"), ("quantize-int8", "int8_qdq")]:
        first, second = (read_manifest(r.output(task, name))["files"] for r in (run, rerun))
        differ = {f for f in first.keys() | second.keys() if first.get(f) != second.get(f)}
        assert all(is_run_record(f) for f in differ), f"{task}/{name}: {sorted(differ)} differ between the runs"
    shards = [read_manifest(r.output("merge-shards", "cleaned"))["files"] for r in (run, rerun)]
    corpus = [{f: digest for f, digest in files.items() if f.endswith(".parquet")} for files in shards]
    assert corpus[0] == corpus[1] != {}  # the cleaned corpus, from 2 shards and 6 band tasks, and from 1 and 1
    assert rerun.promoted and rerun.parameter("promote", "Output") == _release(root, "v-test")
    assert not storage.exists(_release(root, "v-again", MANIFEST))
    assert not storage.exists(_release(root, "v-again", CLAIM))
    assert json.loads(storage.read_bytes(_release(root, "latest.json")))["version"] == "v-test"


@pytest.fixture(scope="module")
def worse_run(local_run, small_corpus, tracking, tmp_path_factory):
    """Second run into the same registry with a student distilled for 1 step from random weights (its gate baseline
    from the MLflow alias when tracked); its gate compares the student with the teacher too."""
    from lmforge_kfp.pipelines.local_run import run_pipeline_locally

    _, root = local_run
    worse_student = {**SMALL["distill_overrides"], "init": "random", "train.max_steps": 1, "train.warmup_steps": 0}
    evaluate = {
        **SMALL["evaluate_overrides"],
        "gate.max_answer_loss_increase": 0.1,  # the tiny-cpu gate's: within 10 % of the teacher's answer loss
        **({"production_source": "mlflow"} if tracking else {}),
    }
    worse = {**SMALL, "distill_overrides": worse_student, "evaluate_overrides": evaluate}
    params = {
        "corpus_uri": str(small_corpus),
        "qa_uri": "demo://chatterbot",
        "release_root": root,
        "release_version": "v-worse",
        **{k: json.dumps(v) for k, v in worse.items()},
    }
    return run_pipeline_locally(params, tmp_path_factory.mktemp("e2e-worse"))


def test_a_candidate_worse_than_production_is_not_promoted(local_run, worse_run):
    """The gate compares the second run with the release the first run promoted and with its own teacher, and
    stops it before promote."""
    _, root = local_run
    results = json.loads((worse_run.output("evaluate", "evaluation") / "results.json").read_text())
    assert results["passed"] is False
    failed = {c["name"]: c["reason"] for c in results["gate"]["checks"] if c["status"] == "fail"}
    assert "bits_per_byte_vs_production" in failed, failed
    served = results["served_model"]  # its answer loss, ONNX or not: what users would get
    assert failed["answer_loss_vs_teacher"].startswith(f"{served} held-out answer loss increase vs teacher")
    assert results["production"]["version"] == "v-test"
    assert not worse_run.promoted
    assert not (worse_run.run_dir / "serve").exists()  # serve sits under the same gate
    assert not storage.exists(_release(root, "v-worse", MANIFEST))
    latest = json.loads(storage.read_bytes(_release(root, "latest.json")))
    assert latest["version"] == "v-test"


def test_a_person_sees_a_line_per_stage_the_progress_and_what_was_made(local_run):
    from lmforge_kfp.pipelines.summary import summary_lines

    run, root = local_run
    lines = (run.logs / "console.txt").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 150
    for stage in (
        "preflight",
        "clean-shard",
        "tokenize",
        "pretrain",
        "finetune-lora",
        "distill",
        "evaluate",
        "promote",
    ):
        assert any(line.startswith(f"✓ {stage} ") for line in lines), (stage, lines)
    assert any(line.strip().startswith("pretrain step ") for line in lines)
    assert not any("executor_input" in line or "Streamed logs" in line for line in lines)

    summary = summary_lines(run)
    assert "release: scenes v-test (published by this run)" in summary
    assert f"  {_release(root, 'v-test')}" in summary  # a path on its own line, never wrapped inside a sentence
    served = [line for line in summary if line.startswith("served model: ")]
    assert served and "MB" in served[0]
    assert "gate: passed" in "\n".join(summary)
    assert any(line.startswith("data: cleaning kept ") for line in summary)
    assert f"  {run.output('evaluate', 'evaluation') / 'report.html'}" in summary
    assert len(summary) + 1 < 20  # `lmforge run --quiet` prints these after its first line


def test_quiet_shows_nothing_and_verbose_everything_of_the_same_run(local_run, tmp_path):
    from lmforge_kfp.pipelines.console import RunConsole

    run, _ = local_run
    stream = (run.logs / "run.log").read_text(encoding="utf-8")
    for mode, expected in (("quiet", 0), ("verbose", stream.count("\n"))):
        shown = io.StringIO()
        console = RunConsole(tmp_path / mode, shown, mode)
        console.write(stream)
        console.close()
        assert shown.getvalue().count("\n") == expected, mode
    per_task = {p.stem for p in run.logs.glob("*.log")}
    assert {"run", "preflight", "pretrain", "evaluate", "promote"} <= per_task


def test_the_dags_partitioned_dedup_cleans_as_the_single_pod_clean_does(local_run, small_corpus, tmp_path):
    """2 shards, 3 band groups × 2 parts in the DAG against clean_shard + dedup_shards + merge in one process."""
    from lmforge.data import clean
    from lmforge.formats.cleaned import read_cleaned
    from lmforge.stages import resolve_stage_config

    run, _ = local_run
    clean.run(resolve_stage_config("clean", "tiny-cpu"), corpus_uri=str(small_corpus), cleaned=tmp_path / "single")
    dag = run.output("merge-shards", "cleaned")
    assert list(read_cleaned(dag)) == list(read_cleaned(tmp_path / "single"))
    removed = json.loads((dag / "stats.json").read_text())["removed"]
    assert removed == json.loads((tmp_path / "single" / "stats.json").read_text())["removed"]
    assert (removed["exact_dedup"], removed["near_dedup"]) == (3, 3)


DAG_STAGES = {
    "preflight": 1,
    "plan_shards": 1,
    "clean_shard": 2,  # clean_shards=2: one run per shard
    "plan_dedup": 1,
    "dedup_exact_part": 2,  # dedup_parts=2
    "dedup_band_part": 6,  # dedup_band_groups=3 x dedup_parts=2
    "dedup_union": 1,
    "serve": 1,
    "merge_shards": 1,
    "tokenize": 1,
    "pretrain": 1,
    "finetune_lora": 1,
    "distill": 1,
    "export_onnx": 1,
    "quantize_int8": 1,
    "build_tensorrt": 1,
    "evaluate": 1,
}


def _tracked(tracking) -> tuple:
    if tracking is None:
        pytest.skip("no MLflow server: see tests/support/mlflow_server.py")
    from mlflow import MlflowClient

    server, experiment, _ = tracking
    client = MlflowClient(server.uri, server.uri)
    return client, client.get_experiment_by_name(experiment).experiment_id


def _pipeline_runs(tracking, run) -> tuple:
    """The parent MLflow run of a local run and its children."""
    client, experiment = _tracked(tracking)
    runs = client.search_runs([experiment], f"tags.`kfp.pipeline_run_id` = '{run.run_dir.parent.name}'")
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    return client, parent, [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]


def test_the_tracked_run_has_one_parent_and_a_child_per_stage_with_params_metrics_history_and_gate(local_run, tracking):
    run, _ = local_run
    client, parent, children = _pipeline_runs(tracking, run)
    by_stage: dict[str, list] = {}
    for child in children:
        by_stage.setdefault(child.data.tags["lmforge.stage"], []).append(child)
    assert {stage: len(runs) for stage, runs in by_stage.items()} == {**DAG_STAGES, "promote": 1}
    assert all(child.info.status == "FINISHED" and child.data.params for child in children)
    assert parent.info.status == "FINISHED"  # ended by promote
    assert parent.data.tags["lmforge.preset"] == "tiny-cpu" and parent.data.tags["lmforge.pipeline_version"]

    (pretrain,) = by_stage["pretrain"]
    assert pretrain.data.params["train.max_steps"] == "30"
    history = json.loads((run.output("pretrain", "model") / "training_history.json").read_text())
    logged = client.get_metric_history(pretrain.info.run_id, "train_loss")
    assert sorted(m.step for m in logged) == history["step"]
    (evaluate,) = by_stage["evaluate"]
    results = json.loads((run.output("evaluate", "evaluation") / "results.json").read_text())
    for check in results["gate"]["checks"]:
        assert evaluate.data.metrics[f"gate.{check['name']}.passed"] == float(check["passed"]), check["name"]
    assert parent.data.metrics["evaluate.student_perplexity"] == pytest.approx(
        results["models"]["student"]["perplexity"]
    )


def test_the_tracked_report_downloads_equal_to_the_evaluation_output(local_run, tracking, tmp_path):
    run, _ = local_run
    client, _, children = _pipeline_runs(tracking, run)
    (evaluate,) = [c for c in children if c.data.tags["lmforge.stage"] == "evaluate"]
    downloaded = client.download_artifacts(evaluate.info.run_id, "evaluation/report.html", str(tmp_path))
    local = run.output("evaluate", "evaluation") / "report.html"
    assert Path(downloaded).read_bytes() == local.read_bytes()


def test_the_release_is_a_registered_model_version_and_a_failed_gate_leaves_the_alias(local_run, worse_run, tracking):
    _, root = local_run
    client, _ = _tracked(tracking)
    (version,) = client.search_model_versions("name='scenes'")
    assert version.source == _release(root, "v-test")
    assert version.tags["lmforge.version"] == "v-test" and version.tags["gate.passed"] == "true"
    assert client.get_registered_model("scenes").aliases == {"production": version.version}
    # The second run's gate read its baseline from that alias, failed, and promote did not run.
    results = json.loads((worse_run.output("evaluate", "evaluation") / "results.json").read_text())
    assert results["production"]["source"] == "mlflow"
    _, parent, children = _pipeline_runs(tracking, worse_run)
    assert "promote" not in {c.data.tags["lmforge.stage"] for c in children}
    assert parent.info.status == "FINISHED"  # ended by the failed gate


def test_no_credential_reaches_any_param_tag_or_artifact_of_the_tracked_runs(local_run, worse_run, tracking, tmp_path):
    from tests.support.s3server import ACCESS_KEY, SECRET_KEY

    client, experiment = _tracked(tracking)
    runs = client.search_runs([experiment], max_results=1000)
    assert len(runs) > 2 * len(DAG_STAGES)
    texts = [json.dumps({**r.data.params, **r.data.tags}) for r in runs]
    for r in runs:
        folder = Path(client.download_artifacts(r.info.run_id, "", str(tmp_path / r.info.run_id)))
        texts += [p.read_bytes().decode("utf-8", "replace") for p in folder.rglob("*") if p.is_file()]
    (version,) = client.search_model_versions("name='scenes'")
    texts.append(json.dumps(version.tags))
    for secret in (SECRET_KEY, ACCESS_KEY):
        assert not [t for t in texts if secret in t]
