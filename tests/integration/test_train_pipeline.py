"""Pipeline parallelism under torchrun (gloo, CPU) matches one process at the same global batch: a Llama on 2
stages (1F1B, uneven blocks, tied head on the other stage), 2 stages × 2 data-parallel shards and 2 stages × 2
tensor-parallel ranks on 4 ranks; a checkpoint saved with stages resumes on one process and on 4 data-parallel
shards, and one saved without stages resumes on 2 stages; the exported model is a plain, whole HF model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lmforge.config import DistributedConfig, ModelConfig, PretrainConfig, TrainConfig
from lmforge.train import pretrain
from lmforge.train.checkpoint import step_name
from tests.support.distributed_child import launch
from tests.support.tiny_training import read_history, worst_difference

STEPS, SAVED_AT, GLOBAL_BATCH, MICRO_BATCHES = 20, 10, 8, 4
LLAMA = ModelConfig(arch="llama", n_layer=3, n_head=4, n_kv_head=2, n_embd=32, block_size=64)


def _cfg(
    model: ModelConfig,
    mesh: dict,
    *,
    checkpoint_dir: Path | None = None,
    recompute: bool = False,
) -> PretrainConfig:
    """fsdp2 in fp32, the gradient norm clipped at every step (so it must be the whole pipeline's); ``mesh`` ``{}``
    is one process. The global batch is GLOBAL_BATCH sequences in micro-batches of 2 on every mesh."""
    distributed = {"backend": "fsdp2", "mesh": mesh}
    data_ranks = mesh.get("data_parallel_shard", 1)
    return PretrainConfig(
        model=model,
        train=TrainConfig(
            max_steps=STEPS, batch_size=GLOBAL_BATCH // MICRO_BATCHES, grad_accum=MICRO_BATCHES // data_ranks,
            seq_len=32, lr=3e-3, min_lr=3e-4, warmup_steps=4, precision="fp32", eval_interval=SAVED_AT,
            eval_batches=2, log_interval=1, seed=7, grad_checkpointing=recompute, grad_clip=0.1,
            checkpoint={"dir": str(checkpoint_dir) if checkpoint_dir else None, "every_steps": SAVED_AT,
                        "every_minutes": 0},
            distributed=DistributedConfig.model_validate(distributed),
        ),
    )  # fmt: skip


def _job(cfg: PretrainConfig, out: Path) -> list[str]:
    return [cfg.model_dump_json(), str(out)]


def _resume_dir(root: Path, name: str, run: str = "pp2") -> Path:
    """A checkpoint dir holding only ``run``'s checkpoint of step SAVED_AT."""
    target = root / name
    shutil.copytree(root / f"{run}_checkpoints" / step_name(SAVED_AT), target / step_name(SAVED_AT))
    return target


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_shards_dir, tiny_tokenizer_dir) -> dict[str, Path]:
    """The one-process reference (fsdp2 on one rank: DCP checkpoints, whose step 10 resumes on 2 stages); 2 stages
    of a Llama (checkpointing) on 2 ranks; 2 stages × 2 shards (recomputing activations) and 2 stages × TP=2 on 4
    ranks; the 2-stage checkpoint of step 10 resumed on one process and on dp_shard=4. (A GPT-2 on 2 stages × TP=2,
    GPipe: tests/integration/test_train_tensor_parallel_gpt2.py.)"""
    root = tmp_path_factory.mktemp("pipeline")
    data = {"shards": str(tiny_shards_dir), "tokenizer": str(tiny_tokenizer_dir)}

    def one_process(cfg: PretrainConfig, name: str) -> None:
        pretrain.run(cfg, shards=tiny_shards_dir, tokenizer=tiny_tokenizer_dir, model=root / name)

    one_process(_cfg(LLAMA, {}, checkpoint_dir=root / "single_checkpoints"), "single")
    pp2 = _cfg(LLAMA, {"pipeline_parallel": 2}, checkpoint_dir=root / "pp2_checkpoints")
    resumed_pp2 = _cfg(LLAMA, {"pipeline_parallel": 2}, checkpoint_dir=_resume_dir(root, "resume_pp2", "single"))
    launch([_job(pp2, root / "pp2"), _job(resumed_pp2, root / "resumed_pp2")], **data)
    pp2_dp2 = _cfg(LLAMA, {"pipeline_parallel": 2, "data_parallel_shard": 2}, recompute=True)
    pp2_tp2 = _cfg(LLAMA, {"pipeline_parallel": 2, "tensor_parallel": 2})
    resumed_dp4 = _cfg(LLAMA, {"data_parallel_shard": 4}, checkpoint_dir=_resume_dir(root, "resume_dp4"))
    jobs = [_job(pp2_dp2, root / "pp2_dp2"), _job(pp2_tp2, root / "pp2_tp2"), _job(resumed_dp4, root / "resumed_dp4")]
    launch(jobs, nproc=4, **data)
    one_process(_cfg(LLAMA, {}, checkpoint_dir=_resume_dir(root, "resume_one")), "resumed_one")
    return {path.name: path for path in root.iterdir()}


def _history(model_dir: Path) -> dict:
    return read_history(model_dir, STEPS)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "reference"),
    [("pp2", "single"), ("pp2_dp2", "single"), ("pp2_tp2", "single")],
)
def test_pipeline_matches_one_process_within_1e4_at_every_step(runs, name, reference):
    ours, one = _history(runs[name]), _history(runs[reference])
    assert worst_difference(ours["train_loss"], one["train_loss"]) <= 1e-4, f"{name}: max |Δloss|"
    assert worst_difference(ours["grad_norm"], one["grad_norm"]) <= 1e-4, f"{name}: max |Δgrad norm|"
    assert worst_difference(ours["eval_loss"], one["eval_loss"]) <= 1e-4, f"{name}: max |Δeval loss|"


@pytest.mark.slow
@pytest.mark.parametrize(("name", "uninterrupted"), [("resumed_one", "pp2"), ("resumed_dp4", "pp2"),
                                                      ("resumed_pp2", "single")])  # fmt: skip
def test_checkpoint_resumes_at_another_mesh_with_the_same_losses(runs, name, uninterrupted):
    resumed, uninterrupted = _history(runs[name]), _history(runs[uninterrupted])
    assert resumed["resumed_from"] == SAVED_AT
    after = slice(SAVED_AT, STEPS)
    assert worst_difference(resumed["train_loss"][after], uninterrupted["train_loss"][after]) <= 1e-4, name


@pytest.mark.slow
def test_exported_model_is_whole_and_generates_in_transformers(runs):
    ours, one = load_file(runs["pp2"] / "model.safetensors"), load_file(runs["single"] / "model.safetensors")
    assert ours.keys() == one.keys()
    assert max(float((ours[k] - one[k]).abs().max()) for k in one) <= 1e-3
    model = AutoModelForCausalLM.from_pretrained(runs["pp2"])
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)
