"""Checkpoints that cannot run code on load, and resume past a corrupted newest checkpoint (docs/security.md, M2/M4)."""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from lmforge import storage
from lmforge.artifacts import MANIFEST, describe_files
from lmforge.config import CheckpointConfig, DistributedConfig, PretrainConfig
from lmforge.contracts import HISTORY_FILE
from lmforge.errors import UnsafeCheckpointError
from lmforge.train import pretrain
from lmforge.train.checkpoint import QUARANTINE, Checkpointer, complete_steps, step_name
from lmforge.train.distributed import DistContext
from tests.support.tiny_training import tiny_pretrain


class _Payload:
    """Unpickling this creates ``marker``: what an attacker's code would do, made visible."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _craft(folder: Path, name: str, marker: Path) -> None:
    """Replace ``folder/name`` by a pickle that runs code, and rewrite the manifest to match (as a writer can)."""
    torch.save({"module": _Payload(marker)}, folder / name)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"] = describe_files(folder)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def _cfg(max_steps: int, checkpoint_dir: str, distributed: dict | None = None, batch_size: int = 4) -> PretrainConfig:
    return tiny_pretrain(
        max_steps=max_steps, batch_size=batch_size, warmup_steps=1, eval_interval=max_steps, eval_batches=1,
        log_interval=1, distributed=DistributedConfig.model_validate(distributed or {}),
        checkpoint=CheckpointConfig(dir=checkpoint_dir, every_steps=2, every_minutes=0.0, keep_last=3),
    )  # fmt: skip


def test_a_crafted_pickle_in_a_checkpoint_is_refused_before_it_is_unpickled(tmp_path):
    ckpt = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt"), every_steps=1), DistContext())

    def write(folder: Path) -> None:
        (folder / "deepspeed").mkdir()
        torch.save({"module": {"w": torch.ones(2)}}, folder / "deepspeed" / "mp_rank_00_model_states.pt")

    ckpt.save(4, write)
    marker = tmp_path / "PWNED"
    _craft(tmp_path / "ckpt" / step_name(4), "deepspeed/mp_rank_00_model_states.pt", marker)

    with pytest.raises(
        UnsafeCheckpointError,
        match=r"step-00000004/deepspeed/mp_rank_00_model_states\.pt: refused.*Unsupported global: GLOBAL io\.open",
    ):
        ckpt.fetch(4, tmp_path / "work")
    assert not marker.exists()


class _ShellPayload:
    """Unpickling this runs a shell command that creates ``marker``: a real attack on ``torch.load``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def test_a_checkpoint_calling_a_blocked_module_is_refused_naming_the_global(tmp_path):
    # torch >= 2.7 words a global of a blocked module (os, subprocess) differently from any other refused global
    ckpt = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt"), every_steps=1), DistContext())
    ckpt.save(2, lambda folder: torch.save({"w": torch.ones(2)}, folder / "optimizer.pt"))
    folder = tmp_path / "ckpt" / step_name(2)
    marker = tmp_path / "PWNED"
    torch.save({"state": _ShellPayload(marker)}, folder / "optimizer.pt")
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**manifest, "files": describe_files(folder)}))

    with pytest.raises(UnsafeCheckpointError) as refused:
        ckpt.fetch(2, tmp_path / "work")
    assert f"Unsupported global: GLOBAL {os.system.__module__}.system" in str(refused.value)
    assert not marker.exists()


def _torn(folder: Path, marker: Path) -> None:
    (folder / "optimizer.pt").write_bytes(b"torn")


def _manifest_not_json(folder: Path, marker: Path) -> None:
    (folder / MANIFEST).write_text('{"kind": "checkpoint", ')


def _manifest_of_another_shape(folder: Path, marker: Path) -> None:
    (folder / MANIFEST).write_text('{"kind": "checkpoint", "step": 4, "files": {"optimizer.pt": 1}}')


def _crafted(folder: Path, marker: Path) -> None:
    _craft(folder, "optimizer.pt", marker)


@pytest.mark.parametrize("corrupt", [_torn, _manifest_not_json, _manifest_of_another_shape, _crafted])
def test_resume_skips_a_bad_newest_checkpoint_quarantines_it_and_keeps_the_older_one(corrupt, tmp_path, caplog):
    root = tmp_path / "ckpt"
    ckpt = Checkpointer(CheckpointConfig(dir=str(root), every_steps=1, keep_last=5), DistContext())
    for step in (2, 4):
        ckpt.save(step, lambda folder, s=step: torch.save({"w": torch.full((2,), float(s))}, folder / "optimizer.pt"))
    marker = tmp_path / "PWNED"
    corrupt(root / step_name(4), marker)

    with caplog.at_level(logging.WARNING, logger="lmforge.train"):
        step, folder = ckpt.fetch_newest_valid(tmp_path / "work")
    assert step == 2 and torch.load(folder / "optimizer.pt", weights_only=True)["w"].tolist() == [2.0, 2.0]
    assert not marker.exists()
    assert complete_steps(str(root)) == [2]
    [moved] = ckpt.quarantined
    assert moved["uri"] == str(root / step_name(4))
    assert Path(moved["moved_to"]).parent == root / QUARANTINE and (Path(moved["moved_to"]) / "optimizer.pt").is_file()
    assert str(root / step_name(4)) in caplog.text


@pytest.mark.s3
def test_corrupted_newest_checkpoint_on_s3_resumes_from_the_previous_one_and_names_its_uri(
    tmp_path, s3_env, tiny_shards_dir, tiny_tokenizer_dir, caplog
):
    uri = f"s3://{s3_env}/runs/r1/ckpt"
    inputs = {"shards": tiny_shards_dir, "tokenizer": tiny_tokenizer_dir}
    pretrain.run(_cfg(4, uri), **inputs, model=tmp_path / "first")
    assert complete_steps(uri) == [2, 4]
    bad = storage.join(uri, step_name(4))
    storage.write_bytes(
        storage.join(bad, "model.safetensors"), b"torn upload"
    )  # the manifest still names the old sha256

    with caplog.at_level(logging.WARNING, logger="lmforge.train"):
        result = pretrain.run(_cfg(6, uri), **inputs, model=tmp_path / "second")

    history = json.loads((tmp_path / "second" / HISTORY_FILE).read_text())
    assert history["resumed_from"] == 2
    [moved] = history["quarantined_checkpoints"]
    assert moved["uri"] == bad and "sha256 mismatch" in moved["reason"] and bad in moved["reason"]
    assert "lmforge-resume-" not in moved["reason"]  # the URI, not this machine's temporary copy
    assert moved["moved_to"].startswith(storage.join(uri, QUARANTINE) + "/")
    assert storage.is_file(storage.join(moved["moved_to"], "model.safetensors"))
    assert result.summary["quarantined_checkpoints"] == [bad]
    assert result.metrics["quarantined_checkpoints"] == 1.0
    assert bad in result.html.replace("<wbr>", "") and bad in caplog.text  # the report may break paths at separators
    assert complete_steps(uri) == [2, 4, 6]  # step 4 written again by the resumed run


@pytest.mark.slow
def test_deepspeed_resume_refuses_a_crafted_model_states_file_and_resumes_the_older_checkpoint(
    tmp_path, tiny_shards_dir, tiny_tokenizer_dir
):
    """Two torchrun jobs (one gloo rank, ZeRO-2; the rank count is not the subject): the first writes steps 2 and 4;
    step 4's ``mp_rank_00_model_states.pt`` is replaced by a pickle that creates a file when unpickled; the second
    resumes from step 2 through the tensor-only loader and the payload never runs."""
    from tests.support.distributed_child import launch

    zero2 = {"backend": "deepspeed", "deepspeed": {"zero": {"stage": 2}}}
    root = tmp_path / "ckpt"
    io = {"shards": str(tiny_shards_dir), "tokenizer": str(tiny_tokenizer_dir)}
    launch([[_cfg(4, str(root), zero2, batch_size=2).model_dump_json(), str(tmp_path / "first")]], nproc=1, **io)
    assert complete_steps(str(root)) == [2, 4]
    marker = tmp_path / "PWNED"
    _craft(root / step_name(4), "deepspeed/mp_rank_00_model_states.pt", marker)

    launch([[_cfg(6, str(root), zero2, batch_size=2).model_dump_json(), str(tmp_path / "second")]], nproc=1, **io)

    assert not marker.exists()
    history = json.loads((tmp_path / "second" / HISTORY_FILE).read_text())
    assert history["resumed_from"] == 2  # a real ZeRO-2 checkpoint loads through the weights_only allowlist
    [moved] = history["quarantined_checkpoints"]
    assert moved["uri"] == str(root / step_name(4)) and "Unsupported global: GLOBAL io.open" in moved["reason"]


def _state_of_the_wrong_shape(folder: Path) -> str:
    (folder / "trainer_state.json").write_text('{"step": 4, "history": []}')
    return "trainer_state.json: 'global_batch' is missing"


def _rng_of_the_wrong_shape(folder: Path) -> str:
    (folder / "rng.json").write_text('[{"torch": [1, 2, 3], "cuda": null, "numpy": [], "python": []}]')
    return "rng.json: the RNG state of rank 0 does not load"


def _weights_of_another_model(folder: Path) -> str:
    from safetensors.torch import save_file

    save_file({"transformer.wte.weight": torch.zeros(7, 3)}, folder / "model.safetensors")
    return "model.safetensors: tensor 'transformer.wte.weight' has shape [7, 3], the model's is"


def _optimizer_of_another_model(folder: Path) -> str:
    torch.save({"state": {}, "param_groups": [{"params": [0]}]}, folder / "optimizer.pt")
    return "optimizer.pt: parameter groups of sizes [1], the optimizer's are"


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, tiny_shards_dir, tiny_tokenizer_dir) -> Path:
    root = tmp_path_factory.mktemp("two-checkpoints")
    pretrain.run(_cfg(4, str(root / "ckpt")), shards=tiny_shards_dir, tokenizer=tiny_tokenizer_dir, model=root / "m")
    assert complete_steps(str(root / "ckpt")) == [2, 4]
    return root / "ckpt"


@pytest.mark.parametrize(
    "corrupt",
    [_state_of_the_wrong_shape, _rng_of_the_wrong_shape, _weights_of_another_model, _optimizer_of_another_model],
)
def test_a_newest_checkpoint_whose_files_resume_cannot_use_is_quarantined_and_the_older_one_resumed(
    corrupt, tmp_path, two_checkpoints, tiny_shards_dir, tiny_tokenizer_dir
):
    root = tmp_path / "ckpt"
    shutil.copytree(two_checkpoints, root)
    newest = root / step_name(4)
    expected = corrupt(newest)
    manifest = json.loads((newest / MANIFEST).read_text())
    (newest / MANIFEST).write_text(json.dumps({**manifest, "files": describe_files(newest)}))  # as a writer can

    inputs = {"shards": tiny_shards_dir, "tokenizer": tiny_tokenizer_dir}
    result = pretrain.run(_cfg(6, str(root)), **inputs, model=tmp_path / "second")

    history = json.loads((tmp_path / "second" / HISTORY_FILE).read_text())
    assert history["resumed_from"] == 2
    [moved] = history["quarantined_checkpoints"]
    assert moved["uri"] == str(newest) and f"{newest}/{expected}" in moved["reason"]
    assert result.summary["quarantined_checkpoints"] == [str(newest)]
