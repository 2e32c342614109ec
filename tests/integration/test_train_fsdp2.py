"""FSDP2, tensor parallelism and both together under torchrun (gloo, CPU) match one process at the same global
batch; a distributed checkpoint saved at one mesh resumes at another; the exported model is a plain HF model; LoRA on
a sharded base matches one process and saves an adapter that peft loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lmforge.config import DistillConfig, DistributedConfig, LoraConfig, ModelConfig, PretrainConfig, TrainConfig
from lmforge.contracts import HISTORY_FILE
from lmforge.model.build import load_causal_lm
from lmforge.train import distill, finetune_lora, pretrain
from lmforge.train.checkpoint import step_name
from lmforge.train.dcp import read_metadata
from tests.support.distributed_child import launch
from tests.support.tiny_training import read_history, worst_difference

STEPS, SAVED_AT, DISTILL_STEPS, LORA_STEPS = 20, 10, 6, 6
GLOBAL_BATCH = 8
FSDP2 = "fsdp2"


def _cfg(
    mesh: dict | None,
    *,
    checkpoint_dir: Path | None = None,
    every_steps: int = 10 * STEPS,
    recompute: bool = False,
    grad_accum: int = 1,
) -> PretrainConfig:
    """A tiny Llama (GQA, SwiGLU) in fp32; ``mesh`` None is the one-process torch backend; ``recompute``: activation
    checkpointing (the same math); the global batch stays GLOBAL_BATCH with ``grad_accum`` micro-batches. The gradient
    norm is clipped at every step, so it must be the whole mesh's."""
    distributed = {"backend": "torch"} if mesh is None else {"backend": FSDP2, "mesh": mesh}
    data_ranks = 1 if mesh is None else mesh.get("data_parallel_shard", 1)
    return PretrainConfig(
        model=ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=64),
        train=TrainConfig(
            max_steps=STEPS, batch_size=GLOBAL_BATCH // data_ranks // grad_accum, grad_accum=grad_accum,
            seq_len=32, lr=3e-3, min_lr=3e-4, warmup_steps=4, precision="fp32", eval_interval=STEPS, eval_batches=1,
            log_interval=1, seed=7, grad_checkpointing=recompute, grad_clip=0.1,
            checkpoint={"dir": str(checkpoint_dir) if checkpoint_dir else None, "every_steps": every_steps,
                        "every_minutes": 0},
            distributed=DistributedConfig.model_validate(distributed),
        ),
    )  # fmt: skip


def _job(cfg: PretrainConfig, out: Path) -> list[str]:
    return [cfg.model_dump_json(), str(out)]


def _distill(data_ranks: int) -> DistillConfig:
    """Distillation of the tiny GPT-2 into a one-layer student, data-parallel over ``data_ranks`` FSDP2 ranks."""
    train = TrainConfig(
        max_steps=DISTILL_STEPS, batch_size=GLOBAL_BATCH // data_ranks, seq_len=32, lr=5e-3, min_lr=5e-4,
        warmup_steps=2, precision="fp32", eval_interval=DISTILL_STEPS, eval_batches=data_ranks, log_interval=1,
        distributed=DistributedConfig(backend=FSDP2),
    )  # fmt: skip
    return DistillConfig(student_layer_fraction=0.5, alpha=0.5, train=train)


def _lora(data_ranks: int) -> LoraConfig:
    """LoRA on the tiny GPT-2, its base sharded over ``data_ranks`` FSDP2 ranks (1: one plain process, the reference).
    The global batch is 2 micro-batches of 4 examples (examples differ in length and the loop averages
    per-micro-batch means, so the two ranks' micro-batches are one process's two accumulation steps)."""
    train = TrainConfig(
        max_steps=LORA_STEPS, batch_size=4, grad_accum=2 // data_ranks, seq_len=48, lr=5e-3, min_lr=5e-4,
        warmup_steps=2, precision="fp32", eval_interval=LORA_STEPS, eval_batches=1, log_interval=1,
        distributed=DistributedConfig(backend=FSDP2 if data_ranks > 1 else "torch"),
    )  # fmt: skip
    return LoraConfig(r=4, alpha=8, dropout=0.0, train=train)


def _lora_io(base: Path, qa: Path, out: Path) -> dict[str, str]:
    merged = str(out / "merged")
    return {"base_model": str(base), "qa_uri": str(qa), "adapter": str(out / "adapter"), "merged_model": merged}


def _resume_dir(root: Path, name: str) -> Path:
    """A checkpoint dir holding only the tensor-parallel run's checkpoint of step SAVED_AT."""
    target = root / name
    shutil.copytree(root / "tp2_checkpoints" / step_name(SAVED_AT), target / step_name(SAVED_AT))
    return target


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_shards_dir, tiny_tokenizer_dir, tiny_model_dir, qa_jsonl) -> dict[str, Path]:
    """One-process references; dp_shard=2 (2 micro-batches a step), TP=2 (checkpointing), a dp_shard=2
    distillation and a dp_shard=2 LoRA on 2 ranks; 2×2 (recomputing activations) and the TP=2 checkpoint of step 10
    resumed at dp_shard=4 on 4 ranks; the same checkpoint resumed on one process."""
    root = tmp_path_factory.mktemp("fsdp2")
    data = {"shards": str(tiny_shards_dir), "tokenizer": str(tiny_tokenizer_dir)}
    pretrain.run(_cfg(None), shards=tiny_shards_dir, tokenizer=tiny_tokenizer_dir, model=root / "single")
    distill_io = {"teacher": str(tiny_model_dir), "shards": str(tiny_shards_dir)}
    distill.run(_distill(1), **distill_io, student=root / "distill_one")
    finetune_lora.run(_lora(1), **_lora_io(tiny_model_dir, qa_jsonl, root / "lora_one"))
    tp2 = _cfg({"tensor_parallel": 2}, checkpoint_dir=root / "tp2_checkpoints", every_steps=SAVED_AT)
    distill_dp2 = {"stage": "distill", "config": _distill(2).model_dump_json(),
                   "io": {**distill_io, "student": str(root / "distill_dp2")}}  # fmt: skip
    dp2 = _cfg({"data_parallel_shard": 2}, grad_accum=2)  # gradients reduce-scattered on the 2nd micro-batch only
    lora_dp2 = {"stage": "finetune_lora", "config": _lora(2).model_dump_json(),
                "io": _lora_io(tiny_model_dir, qa_jsonl, root / "lora_dp2")}  # fmt: skip
    launch([_job(dp2, root / "dp2"), _job(tp2, root / "tp2"), distill_dp2, lora_dp2], **data)
    dp2_tp2 = _cfg({"data_parallel_shard": 2, "tensor_parallel": 2}, recompute=True)
    resumed_dp4 = _cfg({"data_parallel_shard": 4}, checkpoint_dir=_resume_dir(root, "resume_dp4"))
    launch([_job(dp2_tp2, root / "dp2_tp2"), _job(resumed_dp4, root / "resumed_dp4")], nproc=4, **data)
    resumed_one = _cfg({}, checkpoint_dir=_resume_dir(root, "resume_one"))
    pretrain.run(resumed_one, shards=tiny_shards_dir, tokenizer=tiny_tokenizer_dir, model=root / "resumed_one")
    return {path.name: path for path in root.iterdir()}


def _history(model_dir: Path) -> dict:
    return read_history(model_dir, STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp2", "tp2", "dp2_tp2"])
def test_mesh_matches_one_process_within_1e4_at_every_step(runs, name):
    single, sharded = _history(runs["single"]), _history(runs[name])
    worst = worst_difference(single["train_loss"], sharded["train_loss"])
    assert worst < 1e-4, f"{name}: max |Δloss| {worst:.2e} over {STEPS} steps"
    assert min(single["grad_norm"]) > 0.1  # every step is clipped
    assert sharded["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_distillation_with_a_sharded_student_matches_one_process_within_1e4(runs):
    one, sharded = (json.loads((runs[name] / HISTORY_FILE).read_text()) for name in ("distill_one", "distill_dp2"))
    assert sharded["step"] == list(range(1, DISTILL_STEPS + 1))
    worst = worst_difference(one["train_loss"], sharded["train_loss"])
    assert worst < 1e-4, f"distill: max |Δloss| {worst:.2e} over {DISTILL_STEPS} steps"


@pytest.mark.slow
def test_lora_on_a_sharded_base_matches_one_process_within_1e4_at_every_step(runs):
    one, sharded = (json.loads((runs[name] / "merged" / HISTORY_FILE).read_text()) for name in ("lora_one", "lora_dp2"))
    assert sharded["step"] == list(range(1, LORA_STEPS + 1))
    worst = worst_difference(one["train_loss"], sharded["train_loss"])
    assert worst < 1e-4, f"lora: max |Δloss| {worst:.2e} over {LORA_STEPS} steps"
    assert sharded["eval_loss"] == pytest.approx(one["eval_loss"], abs=1e-4)


@pytest.mark.slow
def test_lora_adapter_gathered_from_a_sharded_base_loads_in_peft_and_equals_the_merged_model(runs, tiny_model_dir):
    """The adapter holds the whole LoRA weights (equal to one process's), and applied to the untouched base it
    computes the merged model's logits: the base stayed frozen."""
    adapter, merged = runs["lora_dp2"] / "adapter", load_causal_lm(runs["lora_dp2"] / "merged")
    weights = load_file(adapter / "adapter_model.safetensors")
    expected = load_file(runs["lora_one"] / "adapter" / "adapter_model.safetensors")
    assert weights.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.allclose(weights[key], tensor, atol=1e-4), key
    adapted = peft.PeftModel.from_pretrained(load_causal_lm(tiny_model_dir), adapter).eval()
    ids = torch.randint(2, merged.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4)


@pytest.mark.slow
def test_tensor_parallel_splits_every_block_matrix_in_two(runs):
    """The TP=2 checkpoint holds each block matrix as two pieces (rows for q/k/v, gate and up; columns for o and
    down), one per rank, and the tied embedding by vocabulary rows; norms are whole."""
    index = read_metadata(runs["tp2_checkpoints"] / step_name(SAVED_AT) / "dcp" / ".metadata").state_dict_metadata

    def offsets(name: str) -> list[list[int]]:
        return sorted(list(chunk.offsets) for chunk in index[f"model.model.{name}"].chunks)

    rows = {"self_attn.q_proj": 16, "self_attn.k_proj": 8, "mlp.gate_proj": 64, "mlp.up_proj": 64}
    for layer in range(2):
        for name, half in rows.items():
            assert offsets(f"layers.{layer}.{name}.weight") == [[0, 0], [half, 0]], name
        for name, half in {"self_attn.o_proj": 16, "mlp.down_proj": 64}.items():
            assert offsets(f"layers.{layer}.{name}.weight") == [[0, 0], [0, half]], name
        assert offsets(f"layers.{layer}.input_layernorm.weight") == [[0]]
    assert offsets("embed_tokens.weight") == [[0, 0], [256, 0]]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resumed_one", "resumed_dp4"])
def test_checkpoint_saved_at_tp2_resumes_at_another_mesh_with_the_same_losses(runs, name):
    history, single = _history(runs[name]), _history(runs["single"])
    assert history["resumed_from"] == SAVED_AT
    after = slice(SAVED_AT, SAVED_AT + 5)
    worst = worst_difference(single["train_loss"][after], history["train_loss"][after])
    assert worst < 1e-4, f"{name}: max |Δloss| {worst:.2e} over steps {SAVED_AT + 1}..{SAVED_AT + 5}"


@pytest.mark.slow
def test_exported_model_is_the_whole_model_and_generates_in_transformers(runs):
    exported, single = load_file(runs["dp2_tp2"] / "model.safetensors"), load_file(runs["single"] / "model.safetensors")
    assert exported.keys() == single.keys()
    for key, tensor in single.items():
        assert torch.allclose(exported[key], tensor, atol=1e-4), key
    model = AutoModelForCausalLM.from_pretrained(runs["dp2_tp2"])
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 8)
