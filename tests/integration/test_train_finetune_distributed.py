"""LoRA and distillation on 2 gloo CPU ranks (DDP, DeepSpeed) match one process; their checkpoints resume.

The 2-rank runs use micro-batch B per rank; the reference is one process with the same global batch: for
distillation micro-batch 2B (fixed-length windows, so every row scores the same number of tokens), for LoRA
micro-batch B with grad_accum 2 (examples differ in length and the loop averages per-micro-batch means, so
the two ranks' micro-batches are the reference's two accumulation steps).
"""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file

from lmforge.artifacts import read_manifest
from lmforge.config import CheckpointConfig, DistillConfig, DistributedConfig, LaunchConfig, LoraConfig, TrainConfig
from lmforge.contracts import HISTORY_FILE
from lmforge.errors import ConfigError
from lmforge.launch import run_training_stage
from lmforge.model.build import load_causal_lm
from lmforge.train import distill, finetune_lora
from lmforge.train import loop as train_loop
from tests.support.distributed_child import launch

STEPS = 6
ZERO2 = {"backend": "deepspeed", "deepspeed": {"zero": {"stage": 2}}}
# threshold 0: every parameter is partitioned (by default the tiny model's would all stay whole on each rank)
ZERO3 = {"backend": "deepspeed", "deepspeed": {"zero": {"stage": 3, "stage3_param_persistence_threshold": 0}}}


def _train(batch_size: int, grad_accum: int, seq_len: int, distributed: dict | None = None, **extra) -> TrainConfig:
    fields = dict(
        max_steps=STEPS, batch_size=batch_size, grad_accum=grad_accum, seq_len=seq_len, lr=5e-3, min_lr=5e-4,
        warmup_steps=2, precision="fp32", eval_interval=STEPS, eval_batches=1, log_interval=1,
        distributed=DistributedConfig.model_validate(distributed or {}),
    )  # fmt: skip
    return TrainConfig(**fields | extra)


def _lora(grad_accum: int, distributed: dict | None = None, **extra) -> LoraConfig:
    return LoraConfig(r=4, alpha=8, dropout=0.0, train=_train(4, grad_accum, 48, distributed, **extra))


def _distill(batch_size: int, distributed: dict | None = None, **extra) -> DistillConfig:
    # the validation set is batch_size × eval_batches windows spread over the val split: 8 either way
    train = _train(batch_size, 1, 32, distributed, eval_batches=8 // batch_size, **extra)
    return DistillConfig(student_layer_fraction=0.5, alpha=0.5, train=train)


def _lora_io(base: Path, qa: Path, out: Path) -> dict[str, str]:
    return {
        "base_model": str(base),
        "qa_uri": str(qa),
        "adapter": str(out / "adapter"),
        "merged_model": str(out / "merged"),
    }


def _distill_io(teacher: Path, shards: Path, out: Path) -> dict[str, str]:
    return {"teacher": str(teacher), "shards": str(shards), "student": str(out / "student")}


# name -> (stage, 2-rank config); each is compared with the single-process reference of its stage
JOBS = {
    "lora_ddp": ("finetune_lora", _lora(1)),
    "lora_zero2": ("finetune_lora", _lora(1, ZERO2)),
    "distill_ddp": ("distill", _distill(4)),
    "distill_zero2": ("distill", _distill(4, ZERO2)),
    # the student is partitioned by deepspeed.initialize and gathered again on rank 0 to be saved
    "distill_zero3": ("distill", _distill(4, ZERO3)),
}
REFERENCE = {"finetune_lora": _lora(2), "distill": _distill(8)}


def _io(stage: str, out: Path, model: Path, shards: Path, qa: Path) -> dict[str, str]:
    return _lora_io(model, qa, out) if stage == "finetune_lora" else _distill_io(model, shards, out)


@pytest.fixture(scope="module")
def references(tmp_path_factory, tiny_model_dir, tiny_shards_dir, qa_jsonl) -> dict[str, Path]:
    """The single-process reference run of each stage (in this process)."""
    root = tmp_path_factory.mktemp("finetune-single")
    finetune_lora.run(REFERENCE["finetune_lora"], **_lora_io(tiny_model_dir, qa_jsonl, root / "finetune_lora"))
    distill.run(REFERENCE["distill"], **_distill_io(tiny_model_dir, tiny_shards_dir, root / "distill"))
    return {stage: root / stage for stage in REFERENCE}


@pytest.fixture(scope="module")
def runs(references, tmp_path_factory, tiny_model_dir, tiny_shards_dir, qa_jsonl) -> dict[str, Path]:
    """The references and every 2-rank job (all in one torchrun)."""
    root = tmp_path_factory.mktemp("finetune-distributed")
    jobs = [
        {
            "stage": stage,
            "config": cfg.model_dump_json(),
            "io": _io(stage, root / name, tiny_model_dir, tiny_shards_dir, qa_jsonl),
        }
        for name, (stage, cfg) in JOBS.items()
    ]
    launch(jobs)
    return {**references, **{name: root / name for name in JOBS}}


def _history(model_dir: Path) -> dict:
    history = json.loads((model_dir / HISTORY_FILE).read_text())
    assert history["step"] == list(range(1, STEPS + 1))
    return history


def _model_dir(run: Path) -> Path:
    return run / "merged" if (run / "merged").exists() else run / "student"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(JOBS))
def test_two_ranks_match_one_process_at_the_same_global_batch_within_1e4_at_every_step(runs, name):
    stage = JOBS[name][0]
    single, multi = _history(_model_dir(runs[stage])), _history(_model_dir(runs[name]))
    worst = max(abs(a - b) for a, b in zip(single["train_loss"], multi["train_loss"], strict=True))
    assert worst < 1e-4, f"{name}: max |Δ train loss| {worst:.2e} over {STEPS} steps"
    assert multi["eval_loss"] == pytest.approx(single["eval_loss"], abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lora_ddp", "lora_zero2"])
def test_adapter_written_by_rank_0_loads_and_equals_the_single_process_adapter(runs, name, tiny_model_dir):
    adapter, reference = runs[name] / "adapter", runs["finetune_lora"] / "adapter"
    read_manifest(adapter, verify=True)
    read_manifest(runs[name] / "merged", verify=True)
    weights, expected = (
        load_file(adapter / "adapter_model.safetensors"),
        load_file(reference / "adapter_model.safetensors"),
    )
    assert weights.keys() == expected.keys()
    for key in expected:
        assert torch.allclose(weights[key], expected[key], atol=1e-4), key
    adapted = peft.PeftModel.from_pretrained(load_causal_lm(tiny_model_dir), adapter).eval()
    merged = load_causal_lm(runs[name] / "merged")
    ids = torch.randint(2, merged.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["distill_ddp", "distill_zero2", "distill_zero3"])
def test_student_written_by_rank_0_loads_and_equals_the_single_process_student(runs, name):
    manifest = read_manifest(runs[name] / "student", verify=True)
    assert manifest["metrics"]["kl"] == pytest.approx(
        read_manifest(runs["distill"] / "student")["metrics"]["kl"], abs=1e-4
    )
    student, reference = load_causal_lm(runs[name] / "student"), load_causal_lm(runs["distill"] / "student")
    assert student.config.n_layer == reference.config.n_layer
    expected = reference.state_dict()
    for key, value in student.state_dict().items():
        assert torch.allclose(value, expected[key], atol=1e-4), key


def test_lora_refuses_zero3_naming_the_field(tmp_path, tiny_model_dir, qa_jsonl):
    cfg = _lora(1, ZERO3)
    with pytest.raises(ConfigError, match=r"finetune_lora\.train\.distributed\.deepspeed\.zero\.stage: stage 3"):
        finetune_lora.run(cfg, **_lora_io(tiny_model_dir, qa_jsonl, tmp_path))
    assert not any(tmp_path.iterdir())


class _Crash(Exception):
    pass


@pytest.mark.parametrize("stage", ["finetune_lora", "distill"])
def test_resume_after_a_crash_at_step_3_matches_the_uninterrupted_run(
    stage, references, tmp_path, monkeypatch, tiny_model_dir, tiny_shards_dir, qa_jsonl
):
    checkpoint = CheckpointConfig(dir=str(tmp_path / "checkpoints"), every_steps=3, every_minutes=0)
    if stage == "finetune_lora":
        module, cfg, io = finetune_lora, _lora(2, checkpoint=checkpoint), _lora_io(tiny_model_dir, qa_jsonl, tmp_path)
    else:
        module, cfg, io = (
            distill,
            _distill(8, checkpoint=checkpoint),
            _distill_io(tiny_model_dir, tiny_shards_dir, tmp_path),
        )

    def crash_after_step_3(*args, **kwargs):
        def on_step(step: int, record: dict) -> None:
            if step == 3:
                raise _Crash

        return train_loop.train(*args, **kwargs, on_step=on_step)

    monkeypatch.setattr(module, "train", crash_after_step_3)
    with pytest.raises(_Crash):
        module.run(cfg, **(io))
    monkeypatch.undo()
    assert not any(Path(path).exists() for name, path in io.items() if name in {"adapter", "merged_model", "student"})

    module.run(cfg, **(io))
    resumed, uninterrupted = _history(_model_dir(tmp_path)), _history(_model_dir(references[stage]))
    assert resumed["resumed_from"] == 3
    assert resumed["train_loss"] == pytest.approx(uninterrupted["train_loss"], abs=1e-6)
    assert resumed["eval_loss"] == pytest.approx(uninterrupted["eval_loss"], abs=1e-6)


@pytest.mark.slow
def test_launch_with_two_gpus_per_node_runs_lora_under_torchrun_on_two_ranks(tmp_path, tiny_model_dir, qa_jsonl):
    overrides = {"r": 4, "alpha": 8, "train": {"max_steps": 2, "batch_size": 4, "seq_len": 48, "warmup_steps": 1,
                 "eval_interval": 2, "eval_batches": 1, "log_interval": 1, "precision": "fp32"}}  # fmt: skip
    io = _lora_io(tiny_model_dir, qa_jsonl, tmp_path)
    result = run_training_stage(
        "finetune_lora", LaunchConfig(gpus_per_node=2), io, preset="tiny-cpu", overrides=json.dumps(overrides)
    )
    assert result.summary["launch"] == {"mode": "torchrun", "nproc_per_node": 2}
    assert result.summary["adapter_dir"] == io["adapter"] and "tuned_heldout_loss" in result.metrics
    assert read_manifest(io["adapter"], verify=True)["kind"] == "adapter"
    assert read_manifest(io["merged_model"], verify=True)["kind"] == "model"
