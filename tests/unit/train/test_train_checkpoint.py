"""Checkpoints: atomic writes, keep-last, exact resume after SIGKILL, SIGTERM and S3."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmforge.artifacts import MANIFEST
from lmforge.config import CheckpointConfig, ModelConfig, PretrainConfig, TrainConfig
from lmforge.contracts import HISTORY_FILE
from lmforge.errors import ConfigError
from lmforge.train import pretrain
from lmforge.train.checkpoint import Checkpointer, complete_steps, step_name
from lmforge.train.distributed import DistContext
from lmforge.train.loop import TrainingPreempted

CHILD = Path(__file__).parents[2] / "support" / "pretrain_child.py"


def _cfg(max_steps: int = 16, **checkpoint) -> PretrainConfig:
    return PretrainConfig(
        model=ModelConfig(arch="gpt2", n_layer=2, n_head=2, n_embd=32, block_size=64),
        train=TrainConfig(
            max_steps=max_steps, batch_size=4, grad_accum=2, seq_len=32, lr=3e-3, min_lr=3e-4, warmup_steps=3,
            precision="fp32", eval_interval=5, eval_batches=1, log_interval=1,
            checkpoint=CheckpointConfig(**checkpoint) if checkpoint else CheckpointConfig(),
        ),
    )  # fmt: skip


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def _assert_bitwise_equal(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), f"{name} differs"
    ha, hb = (json.loads((d / HISTORY_FILE).read_text()) for d in (a, b))
    assert ha["train_loss"] == hb["train_loss"] and ha["eval_loss"] == hb["eval_loss"]


# -- the checkpointer on its own ---------------------------------------------------------------------


def _write(payload: str):
    def write(folder: Path) -> None:
        (folder / "state.txt").write_text(payload)

    return write


def test_keep_last_and_a_crashed_write_never_looks_complete(tmp_path):
    ckpt = Checkpointer(CheckpointConfig(dir=str(tmp_path), every_steps=1, keep_last=2), DistContext())
    for step in (1, 2, 3):
        ckpt.save(step, _write(f"state {step}"))
    assert complete_steps(str(tmp_path)) == [2, 3]

    def crash(folder: Path) -> None:
        (folder / "state.txt").write_text("half")
        raise KeyboardInterrupt("killed mid-write")

    with pytest.raises(KeyboardInterrupt):
        ckpt.save(4, crash)
    assert complete_steps(str(tmp_path)) == [2, 3]  # the half-written step 4 is invisible
    assert ckpt.resume_step() == 3
    assert list(tmp_path.glob(".step-00000004.partial-*"))
    ckpt.save(4, _write("state 4"))
    assert complete_steps(str(tmp_path)) == [3, 4]
    assert not list(tmp_path.glob(".step-*.partial-*"))  # leftovers are cleaned up
    assert (tmp_path / step_name(4) / "state.txt").read_text() == "state 4"
    manifest = json.loads((tmp_path / step_name(4) / MANIFEST).read_text())
    assert manifest["kind"] == "checkpoint" and manifest["step"] == 4 and "state.txt" in manifest["files"]


def test_a_checkpoint_without_manifest_is_not_resumed_from(tmp_path):
    ckpt = Checkpointer(CheckpointConfig(dir=str(tmp_path), every_steps=1), DistContext())
    ckpt.save(5, _write("five"))
    (tmp_path / step_name(7)).mkdir()  # e.g. a copy cut short
    (tmp_path / step_name(7) / "state.txt").write_text("seven")
    assert ckpt.resume_step() == 5


def test_checkpoints_are_due_by_steps(tmp_path):
    ckpt = Checkpointer(CheckpointConfig(dir=str(tmp_path), every_steps=3, every_minutes=0), DistContext())
    assert [s for s in range(1, 10) if ckpt.due(s)] == [3, 6, 9]
    by_time = Checkpointer(CheckpointConfig(dir=str(tmp_path), every_minutes=5), DistContext())
    by_time.last_save -= 301
    assert by_time.due(1)


def test_resume_never_refuses_a_directory_with_checkpoints(tmp_path):
    Checkpointer(CheckpointConfig(dir=str(tmp_path), every_steps=1), DistContext()).save(2, _write("x"))
    never = Checkpointer(CheckpointConfig(dir=str(tmp_path), every_steps=1, resume="never"), DistContext())
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        never.resume_step()


# -- exact resume -------------------------------------------------------------------------------------


def _child(cfg: PretrainConfig, shards: Path, tokenizer: Path, out: Path, hang_at: int | None = None):
    args = [sys.executable, str(CHILD), cfg.model_dump_json(), str(shards), str(tokenizer), str(out)]
    if hang_at is not None:
        args.append(str(hang_at))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow
def test_resume_after_sigkill_at_three_random_steps_matches_uninterrupted_run_bitwise(
    tmp_path, tiny_shards_dir, tiny_tokenizer_dir
):
    inputs = {"shards": tiny_shards_dir, "tokenizer": tiny_tokenizer_dir}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the children (OMP_NUM_THREADS=1): the same kernels, the same bits
    try:
        pretrain.run(_cfg(), **inputs, model=tmp_path / "reference")
    finally:
        torch.set_num_threads(threads)

    cfg = _cfg(dir=str(tmp_path / "ckpt"), every_steps=3, every_minutes=0.0, keep_last=2)
    kills = sorted(random.Random(4).sample(range(2, 15), 3))
    for kill_at in kills:
        proc = _child(cfg, inputs["shards"], inputs["tokenizer"], tmp_path / "resumed", hang_at=kill_at)
        line = proc.stdout.readline()  # blocks until the child reaches the step
        while line and not line.startswith("HANG"):  # libraries (DeepSpeed's accelerator notice) print to stdout too
            line = proc.stdout.readline()
        if line.strip() != f"HANG {kill_at}":
            proc.kill()
            pytest.fail(f"child did not reach step {kill_at}: {line!r}\n{proc.stderr.read()[-3000:]}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        assert not (tmp_path / "resumed").exists()
    final = _child(cfg, inputs["shards"], inputs["tokenizer"], tmp_path / "resumed")
    _, err = final.communicate(timeout=300)
    assert final.returncode == 0, err[-3000:]

    _assert_bitwise_equal(tmp_path / "reference", tmp_path / "resumed")
    history = json.loads((tmp_path / "resumed" / HISTORY_FILE).read_text())
    assert history["resumed_from"] == max(s for s in (3, 6, 9, 12, 15) if s <= kills[-1])
    assert complete_steps(str(tmp_path / "ckpt")) == [12, 15]  # keep_last 2 of every 3rd step
    assert not list((tmp_path / "ckpt").glob(".*"))


def _sigterm_at(step: int):
    def on_step(done: int, record: dict) -> None:
        if done == step:
            os.kill(os.getpid(), signal.SIGTERM)

    return on_step


@pytest.mark.s3
def test_sigterm_checkpoint_on_s3_resumes_identically(
    tmp_path, s3_env, tiny_shards_dir, tiny_tokenizer_dir, monkeypatch
):
    inputs = {"shards": tiny_shards_dir, "tokenizer": tiny_tokenizer_dir}
    pretrain.run(_cfg(max_steps=10), **inputs, model=tmp_path / "reference")

    uri = f"s3://{s3_env}/runs/r1/ckpt"
    cfg = _cfg(max_steps=10, dir=uri, every_steps=4, every_minutes=0.0)
    train = pretrain.train
    monkeypatch.setattr(pretrain, "train", lambda *a, **k: train(*a, **k, on_step=_sigterm_at(5)))
    with pytest.raises(TrainingPreempted, match="stopped after step 6"):
        pretrain.run(cfg, **inputs, model=tmp_path / "resumed")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is removed again
    assert complete_steps(uri) == [4, 6]  # every 4 steps, and the final one after SIGTERM
    assert not (tmp_path / "resumed").exists()

    monkeypatch.setattr(pretrain, "train", train)
    pretrain.run(cfg, **inputs, model=tmp_path / "resumed")
    _assert_bitwise_equal(tmp_path / "reference", tmp_path / "resumed")
    assert json.loads((tmp_path / "resumed" / HISTORY_FILE).read_text())["resumed_from"] == 6
    assert complete_steps(uri) == [4, 6, 8]


def test_resume_with_another_global_batch_is_refused(tmp_path, tiny_shards_dir, tiny_tokenizer_dir):
    cfg = _cfg(max_steps=4, dir=str(tmp_path / "ckpt"), every_steps=2, every_minutes=0.0)
    pretrain.run(cfg, shards=tiny_shards_dir, tokenizer=tiny_tokenizer_dir, model=tmp_path / "a")
    other = cfg.model_copy(update={"train": cfg.train.model_copy(update={"batch_size": 2, "max_steps": 6})})
    with pytest.raises(ConfigError, match="global batch 8"):
        pretrain.run(other, shards=tiny_shards_dir, tokenizer=tiny_tokenizer_dir, model=tmp_path / "b")
