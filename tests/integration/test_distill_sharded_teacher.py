"""Distillation from a teacher sharded by FSDP2 over 2 gloo CPU ranks (``distill.teacher_sharding: fsdp2``) matches
one process holding the whole teacher: the same loss at every step, the same student, the same teacher scores; and
each rank holds half of the teacher's weights.

Each rank runs the teacher on its own micro-batch of B rows; the reference is one process with micro-batch B and
grad_accum 2, whose two accumulation steps are the two ranks' micro-batches (the loop averages per-micro-batch
means, and with examples only the rows of the two ranks differ in length).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmforge.artifacts import read_manifest
from lmforge.config import DistillConfig, DistributedConfig, TrainConfig
from lmforge.config.base import validate_config
from lmforge.contracts import HISTORY_FILE
from lmforge.errors import ConfigError
from lmforge.model.build import load_causal_lm
from lmforge.train import distill
from tests.support.distributed_child import launch

STEPS = 6


def _distill(
    qa_fraction: float, *, alpha: float = 0.5, backend: str = "torch", sharding: str = "fsdp2", grad_accum: int = 1
) -> DistillConfig:
    """The tiny GPT-2 into a one-layer student, fp32, micro-batch 4; ``backend`` is the student's."""
    train = TrainConfig(
        max_steps=STEPS, batch_size=4, grad_accum=grad_accum, seq_len=32, lr=5e-3, min_lr=5e-4, warmup_steps=2,
        precision="fp32", eval_interval=STEPS, eval_batches=2, log_interval=1,
        distributed=DistributedConfig(backend=backend),
    )  # fmt: skip
    return DistillConfig(
        student_layer_fraction=0.5, alpha=alpha, qa_fraction=qa_fraction, teacher_sharding=sharding, train=train
    )


# name -> (2-rank config with the sharded teacher, its one-process reference with the whole teacher)
PAIRS = {
    # corpus windows and examples, the student under DDP
    "mixture": (_distill(0.5), _distill(0.5, sharding="replicated", grad_accum=2)),
    # examples only (each rank's rows padded to its own longest), the student sharded by FSDP2 as well
    "examples": (_distill(1.0, backend="fsdp2"), _distill(1.0, sharding="replicated", grad_accum=2)),
}
# alpha 0: the teacher runs in the final scoring only
ALPHA_ZERO = _distill(0.5, alpha=0.0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, tiny_shards_dir, qa_jsonl) -> dict[str, Path]:
    """Every reference in this process, then every 2-rank run in one torchrun; each maps to its student directory."""
    root = tmp_path_factory.mktemp("sharded-teacher")

    def io(name: str) -> dict[str, str]:
        student = str(root / name / "student")
        return {
            "teacher": str(tiny_model_dir),
            "shards": str(tiny_shards_dir),
            "qa_uri": str(qa_jsonl),
            "student": student,
        }

    for name, (_, reference) in PAIRS.items():
        distill.run(reference, **io(f"{name}_one"))
    jobs = {f"{name}_sharded": sharded for name, (sharded, _) in PAIRS.items()} | {"alpha0_sharded": ALPHA_ZERO}
    launch([{"stage": "distill", "config": cfg.model_dump_json(), "io": io(name)} for name, cfg in jobs.items()])
    return {path.name: path / "student" for path in root.iterdir()}


def _history(student: Path) -> dict:
    history = json.loads((student / HISTORY_FILE).read_text())
    assert history["step"] == list(range(1, STEPS + 1))
    return history


@pytest.mark.slow
@pytest.mark.parametrize("name", PAIRS)
def test_sharded_teacher_gives_the_one_process_losses_within_1e4_at_every_step(runs, name):
    one, sharded = _history(runs[f"{name}_one"]), _history(runs[f"{name}_sharded"])
    worst = max(abs(a - b) for a, b in zip(one["train_loss"], sharded["train_loss"], strict=True))
    assert worst < 1e-4, f"{name}: max |Δloss| {worst:.2e} over {STEPS} steps"
    assert sharded["eval_loss"] == pytest.approx(one["eval_loss"], abs=1e-4)
    expected = read_manifest(runs[f"{name}_one"])["metrics"]
    metrics = read_manifest(runs[f"{name}_sharded"], verify=True)["metrics"]
    for key in ("kl", "teacher_val_loss", "student_heldout_answer_loss", "teacher_heldout_answer_loss"):
        assert metrics[key] == pytest.approx(expected[key], abs=1e-4), key


@pytest.mark.slow
@pytest.mark.parametrize("name", PAIRS)
def test_student_of_a_sharded_teacher_equals_the_one_process_student(runs, name):
    student, reference = load_causal_lm(runs[f"{name}_sharded"]), load_causal_lm(runs[f"{name}_one"])
    expected = reference.state_dict()
    assert student.state_dict().keys() == expected.keys()
    for key, value in student.state_dict().items():
        assert torch.allclose(value, expected[key], atol=1e-4), key


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixture_sharded", "examples_sharded", "alpha0_sharded"])
def test_each_rank_holds_half_of_the_sharded_teachers_weights(runs, name):
    """Measured on each rank's local DTensor shards; the whole teacher is what one process holds."""
    teacher = read_manifest(runs[name])["teacher"]
    whole = read_manifest(runs["mixture_one"])["teacher"]
    assert whole["shards"] == 1 and whole["weight_bytes_per_rank"] == whole["weight_bytes"]
    assert teacher["weight_bytes"] == whole["weight_bytes"]
    share = teacher["weight_bytes_per_rank"] / teacher["weight_bytes"]
    assert 0.5 <= share < 0.55, f"{name}: the fullest rank holds {share:.1%} of the teacher"
    assert teacher["sharding"] == "fsdp2" and teacher["shards"] == 2


@pytest.mark.slow
def test_alpha_zero_runs_the_sharded_teacher_only_to_score_it_and_scores_it_as_one_process(runs):
    metrics, expected = (read_manifest(runs[name])["metrics"] for name in ("alpha0_sharded", "mixture_one"))
    for key in ("teacher_val_loss", "teacher_heldout_answer_loss"):  # the teacher's scores do not depend on alpha
        assert metrics[key] == pytest.approx(expected[key], abs=1e-5), key


def test_sharded_teacher_with_a_deepspeed_student_is_refused_naming_the_field():
    data = {"teacher_sharding": "fsdp2", "train": {"distributed": {"backend": "deepspeed"}}}
    with pytest.raises(ConfigError, match=r"distill: .*teacher_sharding fsdp2 .*backend deepspeed"):
        validate_config(DistillConfig, data, "distill")
