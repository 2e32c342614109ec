"""KD loss against a hand computation, and the ``distill`` stage on the tiny model."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmforge.artifacts import read_manifest
from lmforge.config import DistillConfig, ModelConfig
from lmforge.errors import InputDataError
from lmforge.model.build import build_model, load_causal_lm
from lmforge.train import distill
from lmforge.train.losses import kd_loss
from tests.support.tiny_training import tiny_train
from tests.support.token_shards import shards_of_another_tokenizer

STUDENT = torch.tensor([[[1.0, 2.0, 3.0], [0.5, -1.0, 4.0]]])  # (batch 1, 2 positions, vocab 3)
TEACHER = torch.tensor([[[3.0, 2.0, 1.0], [1.0, 0.0, -1.0]]])
LABELS = torch.tensor([[2, -100]])  # the second position is not scored


def _softmax(xs: list[float]) -> list[float]:
    exps = [math.exp(x) for x in xs]
    return [e / sum(exps) for e in exps]


def test_kd_loss_matches_hand_computation_with_t_squared_and_mask():
    t, alpha = 2.0, 0.3
    # position 0 only: p = softmax(teacher/T), q = softmax(student/T)
    p = _softmax([3 / t, 2 / t, 1 / t])
    q = _softmax([1 / t, 2 / t, 3 / t])
    kl = sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q, strict=True))
    ce = -math.log(_softmax([1.0, 2.0, 3.0])[2])
    total, got_kl, got_ce = kd_loss(STUDENT, TEACHER, LABELS, temperature=t, alpha=alpha)
    assert got_kl.item() == pytest.approx(kl, rel=1e-6)
    assert got_ce.item() == pytest.approx(ce, rel=1e-6)
    assert total.item() == pytest.approx(alpha * t**2 * kl + (1 - alpha) * ce, rel=1e-6)


def test_kd_loss_with_alpha_zero_is_cross_entropy():
    labels = torch.tensor([[2, 0]])
    total, _, _ = kd_loss(STUDENT, TEACHER, labels, temperature=3.0, alpha=0.0)
    assert total.item() == pytest.approx(F.cross_entropy(STUDENT[0], labels[0]).item(), rel=1e-6)


def test_kd_loss_is_zero_kl_when_student_equals_teacher_and_grads_reach_student_only():
    student = TEACHER.clone().requires_grad_(True)
    teacher = TEACHER.clone().requires_grad_(True)
    total, kl, _ = kd_loss(student, teacher, LABELS, temperature=2.0, alpha=1.0)
    assert kl.item() == pytest.approx(0.0, abs=1e-7)
    total.backward()
    assert student.grad is not None and teacher.grad is None


@pytest.mark.parametrize(
    ("n", "fraction", "expected"),
    [(4, 0.5, [0, 2]), (2, 0.5, [0]), (12, 0.5, [0, 2, 4, 6, 8, 10]), (3, 1.0, [0, 1, 2]), (6, 0.1, [0])],
)
def test_student_takes_every_kth_teacher_layer(n, fraction, expected):
    assert distill.student_layers(n, fraction) == expected


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_teacher_layer_init_copies_embeddings_head_norm_and_every_other_block(arch):
    shape = ModelConfig(arch=arch, n_layer=4, n_head=2, n_embd=16, block_size=32)
    teacher = build_model(shape, 64, eos_id=0, pad_id=1, seed=0)
    student = distill.make_student(teacher, 0.5, "teacher_layers", seed=1)
    assert student.config.num_hidden_layers == 2
    t_state, s_state = teacher.state_dict(), student.state_dict()
    blocks = "transformer.h" if arch == "gpt2" else "model.layers"
    for key, value in s_state.items():
        source = key.replace(f"{blocks}.1.", f"{blocks}.2.")
        assert torch.equal(value, t_state[source]), key
    ids = torch.randint(0, 64, (1, 8))
    assert student(input_ids=ids).logits.shape == (1, 8, 64)

    fresh = distill.make_student(teacher, 0.5, "random", seed=1)
    assert not torch.equal(fresh.get_input_embeddings().weight, teacher.get_input_embeddings().weight)


CFG = DistillConfig(
    student_layer_fraction=0.5,
    temperature=2.0,
    alpha=0.5,
    train=tiny_train(max_steps=10, batch_size=8, warmup_steps=2, eval_interval=5, eval_batches=2, log_interval=5),
)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_model_dir, tiny_shards_dir) -> tuple[Path, Path]:
    return (
        tiny_model_dir,
        tiny_shards_dir,
    )


def test_distill_writes_half_depth_student_initialized_from_teacher(tmp_path, inputs):
    teacher_dir, shards_dir = inputs
    result = distill.run(CFG, teacher=teacher_dir, shards=shards_dir, student=tmp_path / "student")
    student = load_causal_lm(tmp_path / "student")
    teacher = load_causal_lm(teacher_dir)
    assert student.config.n_layer == teacher.config.n_layer // 2
    assert result.metrics["parameters"] < sum(p.numel() for p in teacher.parameters())
    assert set(result.metrics) == {
        "student_val_loss",
        "teacher_val_loss",
        "student_val_perplexity",
        "teacher_val_perplexity",
        "kl",
        "train_loss",
        "parameters",
        "parameter_fraction",
        "tokens_per_sec",
        "qa_fraction",
        "world_size",
    }  # fmt: skip  (no mfu: a CPU's peak FLOP/s is unknown)
    assert result.metrics["parameter_fraction"] < 1
    assert result.metrics["kl"] >= 0
    history = json.loads((tmp_path / "student" / "training_history.json").read_text())
    assert history["eval_step"] == [0, 5, 10]
    assert history["eval_loss"][-1] < history["eval_loss"][0]
    manifest = read_manifest(tmp_path / "student", verify=True)
    assert manifest["kind"] == "model" and set(manifest["inputs"]) == {"teacher", "shards"}
    assert (tmp_path / "student" / "tokenizer.json").is_file()


def test_student_embeddings_equal_teacher_at_init(inputs):
    teacher = load_causal_lm(inputs[0])
    student = distill.make_student(teacher, 0.5, "teacher_layers", seed=0)
    assert torch.equal(student.transformer.wte.weight, teacher.transformer.wte.weight)
    assert torch.equal(student.transformer.wpe.weight, teacher.transformer.wpe.weight)
    assert torch.equal(student.transformer.ln_f.weight, teacher.transformer.ln_f.weight)


def test_shards_from_another_tokenizer_are_refused(tmp_path, inputs):
    teacher_dir, shards_dir = inputs
    other = shards_of_another_tokenizer(shards_dir, tmp_path / "shards")
    with pytest.raises(InputDataError, match="were written by tokenizer ffffffffffff") as info:
        distill.run(CFG, teacher=teacher_dir, shards=other, student=tmp_path / "student")
    assert "\n" not in str(info.value)


def _student_dir(tmp_path: Path, teacher_dir: Path, *, eos_token: str | None = None) -> Path:
    from lmforge.model.build import load_tokenizer, save_model_dir

    teacher = load_causal_lm(teacher_dir)
    tok = load_tokenizer(teacher_dir)
    if eos_token:
        tok.eos_token = eos_token
    student = distill.make_student(teacher, 0.5, "random", seed=3)
    return save_model_dir(student, tok, tmp_path / "student-init")


def test_student_with_another_tokenizer_is_a_one_line_error(tmp_path, inputs):
    teacher_dir, shards_dir = inputs
    student_dir = _student_dir(tmp_path, teacher_dir, eos_token="<|pad|>")
    with pytest.raises(
        InputDataError,
        match=r"student_base .*student-init does not share the teacher .*'s tokenizer \(eos_token differs "
        r"\('<\|endoftext\|>' vs '<\|pad\|>'\)\); teacher and student must have the same vocabulary",
    ) as info:
        distill.run(CFG, teacher=teacher_dir, shards=shards_dir, student=tmp_path / "out", student_base=student_dir)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_teacher_directory_without_weights_is_a_one_line_error(tmp_path, inputs):
    teacher_dir, shards_dir = inputs
    broken = shutil.copytree(teacher_dir, tmp_path / "teacher")
    (broken / "model.safetensors").unlink()
    with pytest.raises(InputDataError, match=r"teacher: no weights") as info:
        distill.run(CFG, teacher=broken, shards=shards_dir, student=tmp_path / "out")
    assert "\n" not in str(info.value)


def test_invalid_student_source_is_rejected():
    from lmforge.config import validate_config
    from lmforge.errors import ConfigError

    with pytest.raises(ConfigError, match="init"):
        validate_config(DistillConfig, {"init": "pretrained"})  # a pretrained student is the student_base input
    with pytest.raises(ConfigError, match="divergence"):
        validate_config(DistillConfig, {"divergence": "sideways"})


@pytest.mark.s3
def test_teacher_and_pretrained_student_from_s3_with_reverse_kl(tmp_path, s3_env, inputs):
    from lmforge import storage

    teacher_dir, shards_dir = inputs
    teacher_uri = f"s3://{s3_env}/models/teacher"
    storage.copy_tree(str(teacher_dir), teacher_uri)
    student_uri = f"s3://{s3_env}/models/student-init"
    storage.copy_tree(str(_student_dir(tmp_path, teacher_dir)), student_uri)
    cfg = CFG.model_copy(
        update={
            "divergence": "reverse",
            "chunk_tokens": 64,
            "train": CFG.train.model_copy(update={"max_steps": 4, "eval_interval": 4}),
        }
    )
    result = distill.run(
        cfg, teacher=teacher_uri, shards=shards_dir, student=tmp_path / "out", student_base=student_uri
    )
    manifest = read_manifest(tmp_path / "out")
    assert manifest["inputs"]["teacher"]["uri"] == teacher_uri
    assert manifest["inputs"]["student_base"]["uri"] == student_uri
    assert result.metrics["kl"] >= 0 and math.isfinite(result.metrics["student_val_loss"])


def test_alpha_zero_trains_on_cross_entropy_without_running_the_teacher(tmp_path, inputs, monkeypatch):
    teacher_dir, shards_dir = inputs
    calls = []
    original = distill.ChunkedKDLoss.forward
    monkeypatch.setattr(distill.ChunkedKDLoss, "forward", lambda self, *a: calls.append(1) or original(self, *a))
    cfg = CFG.model_copy(update={"alpha": 0.0, "train": CFG.train.model_copy(update={"max_steps": 2})})
    distill.run(cfg, teacher=teacher_dir, shards=shards_dir, student=tmp_path / "out")
    assert len(calls) == cfg.train.eval_batches  # only the final KL diagnostic, never a training step
