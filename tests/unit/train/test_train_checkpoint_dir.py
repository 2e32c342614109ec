"""Templated checkpoint directories: the GPU presets checkpoint under the run's root without a per-run setting."""

from __future__ import annotations

import pytest

from lmforge.config import CheckpointConfig, validate_config
from lmforge.errors import ConfigError
from lmforge.run_context import RunContext
from lmforge.stages import resolve_config
from lmforge.train.checkpoint import resolve_checkpoint_config

TEMPLATE = "{run_root}/checkpoints/{run_id}/{stage}"
RUN = RunContext(run_id="run-42", run_root="s3://bucket/staging/")


def test_placeholders_are_filled_from_the_run_context_and_the_stage(monkeypatch):
    monkeypatch.setenv("LMFORGE_RUN_ID", "not-this-run")  # a context given wins over the environment
    cfg = resolve_checkpoint_config(CheckpointConfig(dir=TEMPLATE), stage="distill", run=RUN)
    assert cfg.dir == "s3://bucket/staging/checkpoints/run-42/distill"


def test_without_a_context_the_placeholders_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("LMFORGE_RUN_ROOT", "/runs/")
    monkeypatch.setenv("LMFORGE_RUN_ID", "run-7")
    cfg = resolve_checkpoint_config(CheckpointConfig(dir=TEMPLATE), stage="pretrain")
    assert cfg.dir == "/runs/checkpoints/run-7/pretrain"


def test_a_plain_directory_is_left_alone():
    cfg = CheckpointConfig(dir="/ckpt/run")
    assert resolve_checkpoint_config(cfg, stage="pretrain", run=RunContext()) is cfg


def test_a_placeholder_without_its_variable_is_a_one_line_error_naming_it():
    with pytest.raises(ConfigError, match=r"pretrain.train.checkpoint.dir .* needs \$LMFORGE_RUN_ID") as info:
        resolve_checkpoint_config(CheckpointConfig(dir=TEMPLATE), stage="pretrain", run=RunContext(run_root="/runs"))
    assert "\n" not in str(info.value) and "null to disable checkpoints" in str(info.value)


def test_an_unknown_placeholder_is_refused_when_the_config_is_validated():
    with pytest.raises(ConfigError, match=r"unknown placeholder\(s\) \['runid'\]"):
        validate_config(CheckpointConfig, {"dir": "{run_root}/{runid}"})


@pytest.mark.parametrize(
    "preset", ["gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1.5b", "llama-1b", "llama-3b", "llama-8b"]
)
def test_every_gpu_preset_checkpoints_every_training_stage_every_5_minutes_keeping_3(preset):
    config = resolve_config(preset)
    for stage in ("pretrain", "finetune_lora", "distill"):
        checkpoint = getattr(config, stage).train.checkpoint
        assert (checkpoint.dir, checkpoint.every_minutes, checkpoint.keep_last, checkpoint.resume) == (
            TEMPLATE,
            5.0,
            3,
            "auto",
        ), (preset, stage)


def test_training_writes_its_checkpoints_under_the_resolved_template(
    tmp_path, monkeypatch, tiny_shards_dir, tiny_tokenizer_dir
):
    from lmforge.config import ModelConfig, PretrainConfig, TrainConfig
    from lmforge.train import pretrain
    from lmforge.train.checkpoint import complete_steps

    monkeypatch.setenv("LMFORGE_RUN_ROOT", str(tmp_path / "root"))
    monkeypatch.setenv("LMFORGE_RUN_ID", "run-7")
    cfg = PretrainConfig(
        model=ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=32),
        train=TrainConfig(
            max_steps=2, batch_size=2, seq_len=16, warmup_steps=1, precision="fp32", eval_interval=2, eval_batches=1,
            checkpoint=CheckpointConfig(dir=TEMPLATE, every_steps=1, every_minutes=0.0),
        ),
    )  # fmt: skip
    pretrain.run(cfg, shards=tiny_shards_dir, tokenizer=tiny_tokenizer_dir, model=tmp_path / "model")
    assert complete_steps(str(tmp_path / "root" / "checkpoints" / "run-7" / "pretrain")) == [1, 2]
