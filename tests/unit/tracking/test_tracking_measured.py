"""The training plan's MFU: measured in the newest tracked run of the same preset, read from a real MLflow server."""

from __future__ import annotations

import json

import pytest

from lmforge.plan import TRAINING_STAGES, Accelerator
from lmforge.preflight.preflight import run_checks
from lmforge.results import StageResult
from lmforge.tracking import PipelineRun, Tracker, track_stage
from lmforge.tracking.measured import measured_mfu

pytestmark = pytest.mark.s3


def test_the_plan_takes_each_stages_mfu_from_the_newest_run_of_the_preset_that_measured_one(tracking_env, tmp_path):
    def pipeline_run(run_id: str, preset: str, stage: str, metrics: dict[str, float]) -> str:
        track_stage(stage, {}, StageResult(metrics=metrics), run_id=run_id, preset=preset)
        return Tracker().pipeline_run_id(PipelineRun(run_id), create=False)

    pipeline_run("old", "tiny-cpu", "pretrain", {"mfu": 0.20})
    measured = pipeline_run("new", "tiny-cpu", "pretrain", {"mfu": 0.31})
    pipeline_run("other-preset", "gpt2-124m", "pretrain", {"mfu": 0.55})
    pipeline_run("no-mfu", "tiny-cpu", "finetune_lora", {"tokens_per_sec": 900.0})

    assert measured_mfu("tiny-cpu", TRAINING_STAGES) == {"pretrain": (0.31, measured)}

    corpus, qa = tmp_path / "docs.jsonl", tmp_path / "qa.jsonl"
    corpus.write_text(json.dumps({"text": "a scene with enough words in it to be a document"}) + "\n")
    qa.write_text(json.dumps({"prompt": "hi", "response": "hello"}) + "\n")
    report = run_checks(
        corpus_uri=str(corpus), qa_uri=str(qa), release_root=str(tmp_path / "registry"), s3_secret_name="",
        preset="tiny-cpu",
    )  # fmt: skip
    stages = {stage["stage"]: stage for stage in report.plan["stages"]}
    pretrain = stages["pretrain"]
    assert (pretrain["mfu"], pretrain["mfu_source"]) == (0.31, f"run {measured}")
    peak = Accelerator.named("H100").peak_flops
    assert pretrain["hours"] == pytest.approx(pretrain["flops"] / (peak * 0.31) / 3600)
    assert stages["finetune_lora"]["mfu_source"] == stages["distill"]["mfu_source"] == "assumed"
