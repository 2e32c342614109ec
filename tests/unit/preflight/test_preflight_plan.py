"""Preflight plans every training stage on the launch's accelerator: console, metrics, the plan output, refusal."""

from __future__ import annotations

import json
import logging
import typing

import pytest

from lmforge.config import LaunchConfig
from lmforge.errors import PreflightError
from lmforge.plan import DEFAULT_MFU, TRAINING_STAGES, Accelerator, plan_training
from lmforge.preflight import preflight
from lmforge.stages import resolve_config
from lmforge.train.mfu import PEAK_FLOPS_BF16


@pytest.fixture
def inputs(tmp_path) -> dict[str, str]:
    corpus, qa = tmp_path / "docs.jsonl", tmp_path / "qa.jsonl"
    corpus.write_text(json.dumps({"text": "a scene with enough words in it to be a document"}) + "\n")
    qa.write_text(json.dumps({"prompt": "hi", "response": "hello"}) + "\n")
    return {"corpus_uri": str(corpus), "qa_uri": str(qa), "release_root": str(tmp_path / "registry")}


def test_the_launch_accelerators_are_the_ones_the_peak_table_knows():
    assert typing.get_args(LaunchConfig.model_fields["accelerator"].annotation) == tuple(PEAK_FLOPS_BF16)


def test_preflight_plans_every_training_stage_logs_a_line_each_and_reports_the_figures(inputs, caplog):
    caplog.set_level(logging.INFO, logger="lmforge.preflight")
    result = preflight.run(**inputs, s3_secret_name="", preset="tiny-cpu", launch='{"accelerator": "A100"}')
    plan = json.loads(result.summary["plan"])
    assert plan["accelerator"]["name"] == "A100" and "data sheet" in plan["accelerator"]["source"]
    assert [stage["stage"] for stage in plan["stages"]] == list(TRAINING_STAGES)
    config = resolve_config("tiny-cpu")
    expected = plan_training(config, vocab_size=config.tokenize.vocab_size, accelerator=Accelerator.named("A100"))
    assert plan["stages"] == [stage.as_dict() for stage in expected]
    assert {stage["mfu_source"] for stage in plan["stages"]} == {"assumed"}
    assert result.summary["checks"]["training_plan"] == "ok"
    for stage in expected:
        assert result.metrics[f"plan_{stage.stage}_gpu_hours"] == stage.gpu_hours
        assert result.metrics[f"plan_{stage.stage}_memory_gb_per_gpu"] == stage.memory_gb_per_gpu
        assert result.metrics[f"plan_{stage.stage}_mfu"] == DEFAULT_MFU
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("preflight plan ")]
    assert [line.split()[2] for line in lines] == [f"{stage}:" for stage in TRAINING_STAGES]
    assert "x A100" in lines[0] and "(assumed)" in lines[0]


def test_preflight_plans_on_the_gpus_the_training_steps_get_from_gpu_count(inputs):
    result = preflight.run(**inputs, s3_secret_name="", preset="tiny-cpu", gpu_count=2)
    assert {stage["gpus"] for stage in json.loads(result.summary["plan"])["stages"]} == {2}


def test_a_plan_over_the_accelerators_memory_fails_preflight_naming_the_stage_estimate_and_what_to_change(inputs):
    with pytest.raises(PreflightError) as info:
        preflight.run_checks(**inputs, s3_secret_name="", preset="llama-1b", launch=LaunchConfig(accelerator="A10G"))
    message = str(info.value)
    assert "training_plan: pretrain: 23." in message and "GB per GPU, over 21.6 GB (A10G 24 GB" in message
    assert "train.grad_checkpointing" in message and "launch.accelerator" in message


def test_a_lora_target_the_model_lacks_fails_the_plan_check_with_the_others(inputs, tmp_path):
    with pytest.raises(PreflightError) as info:
        preflight.run_checks(
            **inputs | {"corpus_uri": str(tmp_path / "missing.jsonl")}, s3_secret_name="", preset="tiny-cpu",
            stage_overrides={"finetune_lora": {"target_modules": ["q_proj"]}},
        )  # fmt: skip
    message = str(info.value)
    assert "training_plan: finetune_lora.target_modules: 'q_proj' matches no module of the gpt2 model" in message
    assert "corpus_readable" in message  # the other checks ran all the same


def test_without_a_preset_nothing_is_planned(inputs):
    result = preflight.run(**inputs, s3_secret_name="", preset="")
    assert result.summary["plan"] == "" and "training_plan" not in result.summary["checks"]
    assert not [name for name in result.metrics if name.startswith("plan_")]
