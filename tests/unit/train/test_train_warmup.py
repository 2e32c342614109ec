"""A warmup longer than the run is clipped to max_steps with a note, so lowering max_steps alone is enough."""

from __future__ import annotations

import json
import logging

import pytest

from lmforge.config import TrainConfig
from lmforge.contracts import HISTORY_FILE
from lmforge.stages import resolve_config, resolve_stage_config
from lmforge.train import distill, finetune_lora, pretrain
from lmforge.train.loop import lr_at


@pytest.mark.parametrize("stage", ["pretrain", "finetune_lora", "distill"])
def test_max_steps_one_alone_validates_with_warmup_clipped_and_a_note(stage, caplog):
    with caplog.at_level(logging.WARNING, logger="lmforge.config"):
        cfg = resolve_config("tiny-cpu", {f"{stage}.train.max_steps": 1})
    train = getattr(cfg, stage).train
    assert (train.max_steps, train.warmup_steps) == (1, 1)
    notes = [r.getMessage() for r in caplog.records if "warmup" in r.getMessage()]
    assert notes and "clipped to 1" in notes[0]


def test_warmup_within_the_run_is_kept_without_a_note(caplog):
    with caplog.at_level(logging.WARNING, logger="lmforge.config"):
        cfg = TrainConfig(max_steps=10, warmup_steps=10)
    assert cfg.warmup_steps == 10
    assert not [r for r in caplog.records if "warmup" in r.getMessage()]


def test_clipped_warmup_reaches_the_peak_rate_on_the_last_step():
    cfg = TrainConfig(max_steps=3, warmup_steps=50, lr=1e-3, min_lr=1e-4)
    assert cfg.warmup_steps == 3
    assert [lr_at(s, cfg) for s in range(3)] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3])


def test_a_clipped_config_dumps_and_validates_again_unchanged():
    cfg = TrainConfig(max_steps=2, warmup_steps=20)
    assert TrainConfig.model_validate(cfg.model_dump()) == cfg


def test_a_wrong_type_is_still_refused_naming_the_field():
    with pytest.raises(ValueError, match="warmup_steps"):
        TrainConfig(max_steps=2, warmup_steps="20")


def _steps(model_dir) -> list[int]:
    return json.loads((model_dir / HISTORY_FILE).read_text())["step"]


def test_one_step_pretrain_lora_and_distill_run_with_only_max_steps_set(
    tmp_path, tiny_shards_dir, tiny_tokenizer_dir, qa_jsonl
):
    one = {"train.max_steps": 1, "train.batch_size": 2, "train.seq_len": 32}
    pre = resolve_stage_config("pretrain", "tiny-cpu", {**one, "model.n_layer": 2})
    pretrain.run(pre, shards=tiny_shards_dir, tokenizer=tiny_tokenizer_dir, model=tmp_path / "base")
    assert _steps(tmp_path / "base")[-1] == 1

    tuned = resolve_stage_config("finetune_lora", "tiny-cpu", one)
    finetune_lora.run(
        tuned,
        base_model=tmp_path / "base",
        qa_uri=str(qa_jsonl),
        adapter=tmp_path / "adapter",
        merged_model=tmp_path / "merged",
    )
    assert _steps(tmp_path / "merged")[-1] == 1

    student = resolve_stage_config("distill", "tiny-cpu", one)
    distill.run(student, teacher=tmp_path / "merged", shards=tiny_shards_dir, student=tmp_path / "student")
    assert _steps(tmp_path / "student")[-1] == 1
