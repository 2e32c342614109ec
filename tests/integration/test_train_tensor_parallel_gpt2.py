"""A GPT-2 split by tensor parallelism (2 gloo ranks under torchrun, and 2 GPipe pipeline stages × TP=2 on 4) trains
as one process does; its distributed checkpoint, written in Hugging Face's column order, resumes on one process and at
TP=2; its export is a plain GPT-2."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoModelForCausalLM

from lmforge.config import DistributedConfig, PretrainConfig
from lmforge.train import pretrain
from lmforge.train.checkpoint import step_name
from lmforge.train.dcp import DCP_DIR, METADATA, TensorOnlyReader, read_metadata
from tests.support.distributed_child import launch
from tests.support.tiny_training import TINY_MODEL, read_history, tiny_train, worst_difference

STEPS, SAVED_AT, GLOBAL_BATCH = 20, 10, 8


def _cfg(mesh: dict, *, checkpoint_dir: Path | None = None, micro_batches: int = 1) -> PretrainConfig:
    """The tiny GPT-2 with 4 heads (fused q/k/v) under fsdp2 on one data-parallel rank, GLOBAL_BATCH sequences a step
    in ``micro_batches``; ``mesh`` ``{}`` is one process. The gradient norm is clipped at every step, so it must be
    the whole model's."""
    distributed = {"backend": "fsdp2", "mesh": mesh}
    checkpoint = {"dir": str(checkpoint_dir) if checkpoint_dir else None, "every_steps": SAVED_AT, "every_minutes": 0}
    train = tiny_train(
        max_steps=STEPS, batch_size=GLOBAL_BATCH // micro_batches, grad_accum=micro_batches, warmup_steps=4,
        eval_interval=STEPS, eval_batches=1, log_interval=1, seed=7, grad_clip=0.1, checkpoint=checkpoint,
        distributed=DistributedConfig.model_validate(distributed),
    )  # fmt: skip
    return PretrainConfig(model=TINY_MODEL.model_copy(update={"n_head": 4}), train=train)


def _resume_dir(root: Path, name: str) -> Path:
    """A checkpoint dir holding only the TP=2 run's checkpoint of step SAVED_AT."""
    target = root / name
    shutil.copytree(root / "tp2_checkpoints" / step_name(SAVED_AT), target / step_name(SAVED_AT))
    return target


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_shards_dir, tiny_tokenizer_dir) -> dict[str, Path]:
    """One process (fsdp2, checkpointing); TP=2 on 2 ranks (checkpointing); its step-10 checkpoint resumed
    at TP=2 and on one process; 2 pipeline stages × TP=2 on 4 ranks (GPipe)."""
    root = tmp_path_factory.mktemp("gpt2_tp")
    data = {"shards": str(tiny_shards_dir), "tokenizer": str(tiny_tokenizer_dir)}
    one = _cfg({}, checkpoint_dir=root / "single_checkpoints")
    pretrain.run(one, shards=tiny_shards_dir, tokenizer=tiny_tokenizer_dir, model=root / "single")
    tp2 = _cfg({"tensor_parallel": 2}, checkpoint_dir=root / "tp2_checkpoints")
    launch([[tp2.model_dump_json(), str(root / "tp2")]], **data)
    resumed_tp2 = _cfg({"tensor_parallel": 2}, checkpoint_dir=_resume_dir(root, "resume_tp2"))
    launch([[resumed_tp2.model_dump_json(), str(root / "resumed_tp2")]], **data)
    resumed_one = _cfg({}, checkpoint_dir=_resume_dir(root, "resume_one"))
    pretrain.run(resumed_one, shards=tiny_shards_dir, tokenizer=tiny_tokenizer_dir, model=root / "resumed_one")
    pp2_tp2 = _cfg({"pipeline_parallel": 2, "pipeline_schedule": "gpipe", "tensor_parallel": 2}, micro_batches=2)
    launch([[pp2_tp2.model_dump_json(), str(root / "pp2_tp2")]], nproc=4, **data)
    return {path.name: path for path in root.iterdir()}


def _history(model_dir: Path) -> dict:
    return read_history(model_dir, STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2", "pp2_tp2"])
def test_gpt2_split_by_tensor_parallelism_matches_one_process_within_1e4_at_every_step(runs, name):
    single, split = _history(runs["single"]), _history(runs[name])
    worst = worst_difference(single["train_loss"], split["train_loss"])
    assert worst < 1e-4, f"{name}: max |Δloss| {worst:.2e} over {STEPS} steps"
    assert min(single["grad_norm"]) > 0.1  # every step is clipped
    worst_norm = worst_difference(single["grad_norm"], split["grad_norm"])
    assert worst_norm < 1e-4, f"{name}: max |Δgrad_norm| {worst_norm:.2e} over {STEPS} steps"


def _checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a distributed checkpoint (weights, Adam moments and steps) by its key, read in this process."""
    index = read_metadata(folder / DCP_DIR / METADATA).state_dict_metadata
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in index.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(state, storage_reader=TensorOnlyReader(folder / DCP_DIR), no_dist=True)
    return state


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # read in this one process on purpose
def test_gpt2_checkpoint_saved_at_tp2_holds_the_one_process_tensors_in_hf_order(runs):
    """The fused q/k/v weight, bias and their Adam moments are written in HF's column order, by HF's names."""
    split = _checkpoint_tensors(runs["tp2_checkpoints"] / step_name(SAVED_AT))
    whole = _checkpoint_tensors(runs["single_checkpoints"] / step_name(SAVED_AT))
    assert split.keys() == whole.keys()
    assert "optimizer.state.transformer.h.1.attn.c_attn.weight.exp_avg_sq" in whole
    for key, tensor in whole.items():  # Adam's second moments are ~1e-8: each tensor is compared at its own scale
        worst = (split[key] - tensor).abs().max().item() / max(tensor.abs().max().item(), 1e-12)
        assert worst < 1e-3, f"{key}: max |Δ| is {worst:.1e} of its largest entry"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resumed_one", "resumed_tp2"])
def test_gpt2_checkpoint_saved_at_tp2_resumes_with_the_same_losses(runs, name):
    """Weights and Adam moments of the fused q/k/v columns are saved in HF's order and read back into each mesh's."""
    history, single = _history(runs[name]), _history(runs["single"])
    assert history["resumed_from"] == SAVED_AT
    after = slice(SAVED_AT, STEPS)
    worst = worst_difference(single["train_loss"][after], history["train_loss"][after])
    assert worst < 1e-4, f"{name}: max |Δloss| {worst:.2e} over steps {SAVED_AT + 1}..{STEPS}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2", "pp2_tp2"])
def test_gpt2_exported_from_tensor_parallel_ranks_is_the_whole_model_and_generates_in_transformers(runs, name):
    """Rank 0 puts the fused q/k/v columns back in HF's order, those of every pipeline stage included."""
    exported, single = load_file(runs[name] / "model.safetensors"), load_file(runs["single"] / "model.safetensors")
    assert exported.keys() == single.keys()
    for key, tensor in single.items():
        worst = (exported[key] - tensor).abs().max().item()
        assert worst < 1e-4, f"{key}: max |Δ| {worst:.2e}"
    model = AutoModelForCausalLM.from_pretrained(runs[name])
    assert model.config.model_type == "gpt2"
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 8)
