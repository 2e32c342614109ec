"""The training plan (lmforge plan): counts against real models, costs against a hand computation."""

from __future__ import annotations

import json

import peft
import pytest
from typer.testing import CliRunner

from lmforge.cli import app
from lmforge.config import DistributedConfig, LaunchConfig, ModelConfig
from lmforge.errors import ConfigError
from lmforge.model.build import build_model
from lmforge.plan import (
    DEFAULT_MFU,
    Accelerator,
    count_parameters,
    layer_activation_bytes,
    lora_trainable_parameters,
    plan_training,
    refuse_oversized,
)
from lmforge.stages import resolve_config, resolve_stage_config
from lmforge.train.distill import make_student
from lmforge.train.finetune_lora import peft_config, target_modules
from lmforge.train.mfu import distillation_model_flops_per_token, lora_model_flops_per_token


def test_gpt2_124m_pretrain_matches_a_hand_computation():
    """GPT-2 small, 1 H100 at the assumed MFU: every figure from the formulas written out here."""
    vocab, d, layers, context = 50257, 768, 12, 1024
    params = vocab * d + context * d + layers * (12 * d * d + 13 * d) + 2 * d  # wte, wpe, blocks, ln_f
    assert params == 124_439_808  # GPT-2 small as published (tied output head)
    steps, micro, accum, seq = 20_000, 16, 32, 1024
    tokens = steps * micro * accum * seq
    flops = tokens * (6 * (params - context * d) + 12 * layers * d * seq)
    memory = 16 * params + 34 * seq * micro * d * layers + 8 * seq * micro * vocab
    hours = flops / (989e12 * DEFAULT_MFU) / 3600

    config = resolve_config("gpt2-124m")
    pretrain = plan_training(config, vocab_size=vocab)[0]

    assert pretrain.stage == "pretrain"
    assert pretrain.parameters == params
    assert pretrain.tokens == tokens
    assert pretrain.flops == pytest.approx(flops, rel=0.10)
    assert pretrain.memory_gb_per_gpu == pytest.approx(memory / 1e9, rel=0.10)
    assert pretrain.hours == pytest.approx(hours, rel=0.10)
    assert pretrain.gpu_hours == pretrain.hours


SHAPES = {
    "gpt2": ModelConfig(arch="gpt2", n_layer=3, n_head=4, n_embd=64, block_size=128),
    "llama": ModelConfig(arch="llama", n_layer=3, n_head=4, n_embd=64, block_size=128),
    "llama-gqa": ModelConfig(arch="llama", n_layer=3, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96),
}


@pytest.mark.parametrize("name", SHAPES)
def test_parameters_counted_on_the_meta_device_equal_the_built_model(name):
    shape = SHAPES[name]
    model = build_model(shape, 1000, eos_id=0, pad_id=1, seed=0)
    total, lookup = count_parameters(shape, 1000)
    assert total == sum(p.numel() for p in model.parameters())
    assert lookup == (128 * 64 if name == "gpt2" else 0)


def test_llama_8b_on_4_nodes_matches_a_hand_computation_with_grouped_query_attention():
    """Llama 3 8B's shape (tied head), 32 H100s, FSDP2 over all of them, checkpointing: parameters and memory
    written out here."""
    vocab, d, layers, kv, mlp, seq, micro, ranks = 128256, 4096, 32, 8 * 128, 14336, 8192, 2, 32
    block = 2 * d * d + 2 * d * kv + 3 * d * mlp + 2 * d  # q, o; k, v at the KV width; gate, up, down; 2 norms
    params = vocab * d + layers * block + d  # tied embedding, blocks, final norm
    assert params == 7_504_924_672  # Meta's untied 8.03 B less its separate 128256 x 4096 output head
    per_token_layer = 14 * d + 4 * kv + 4 * mlp  # 34·d for a GPT block; K, V and the MLP at their own widths
    memory = 16 * params / ranks + seq * micro * (2 * d * layers + per_token_layer) + 8 * seq * micro * vocab

    config = resolve_config("llama-8b")
    pretrain = plan_training(config, vocab_size=vocab, launch=LaunchConfig(num_nodes=4, gpus_per_node=8))[0]

    assert layer_activation_bytes(config.pretrain.model) == per_token_layer < 34 * d
    assert pretrain.parameters == params
    assert pretrain.memory_gb_per_gpu == pytest.approx(memory / 1e9, rel=1e-9)


@pytest.mark.parametrize("preset", ["llama-3b", "llama-8b"])
@pytest.mark.parametrize("nodes", [2, 4])
def test_llama_3_presets_fit_an_80_gb_gpu_with_headroom_on_2_and_4_nodes_of_8(preset, nodes):
    config = resolve_config(preset)
    plans = plan_training(
        config, vocab_size=config.tokenize.vocab_size, launch=LaunchConfig(num_nodes=nodes, gpus_per_node=8)
    )
    refuse_oversized(plans, Accelerator.named("H100"))  # 80 GB less 10 % headroom


def test_a_sharded_teacher_counts_its_share_plus_the_root_and_one_block_gathered():
    """GPT-2 small as the distillation teacher on 8 GPUs, bf16 (2 bytes a weight): replicated, each GPU holds all of
    it; sharded, 1/8 of it plus the root's weights (embeddings, final norm, tied head) and one block's."""
    vocab, d, layers, context, ranks = 50257, 768, 12, 1024, 8
    block = 12 * d * d + 13 * d
    root = vocab * d + context * d + 2 * d  # wte, wpe, ln_f
    params = root + layers * block
    sharded_bytes = 2 * (params / ranks + root + block)
    launch = LaunchConfig(gpus_per_node=ranks)

    replicated = plan_training(resolve_config("gpt2-124m"), vocab_size=vocab, launch=launch)[2]
    config = resolve_config("gpt2-124m", {"distill.teacher_sharding": "fsdp2"})
    sharded = plan_training(config, vocab_size=vocab, launch=launch)[2]

    assert sharded.stage == "distill"
    assert replicated.memory_gb_per_gpu - sharded.memory_gb_per_gpu == pytest.approx(
        (2 * params - sharded_bytes) / 1e9, rel=1e-9
    )
    assert sharded.flops == replicated.flops  # every rank still runs the whole teacher forward on its own batch


def test_lora_trained_parameters_equal_the_stages_peft_model():
    cfg = resolve_stage_config("finetune_lora", "tiny-cpu")
    shape = resolve_config("tiny-cpu").pretrain.model
    model = build_model(shape, 2048, eos_id=0, pad_id=1, seed=0)
    wrapped = peft.get_peft_model(model, peft_config(cfg, model, target_modules(model, cfg.target_modules)))
    expected = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    assert lora_trainable_parameters(cfg, shape, 2048) == expected


def test_the_training_stages_measure_mfu_with_the_plans_flops_per_token():
    """What LoRA and distillation pass to the loop for MFU is what the plan counts per token: the MFU a run
    measures replaces the plan's assumed one like for like."""
    config = resolve_config("tiny-cpu")
    _, lora, distillation = plan_training(config, vocab_size=2048)
    shape = config.pretrain.model
    teacher = build_model(shape, 2048, eos_id=0, pad_id=1, seed=0)
    lora_cfg = config.finetune_lora
    wrapped = peft.get_peft_model(
        build_model(shape, 2048, eos_id=0, pad_id=1, seed=0),
        peft_config(lora_cfg, teacher, target_modules(teacher, lora_cfg.target_modules)),
    )
    assert lora_model_flops_per_token(wrapped, lora_cfg.train.seq_len) == pytest.approx(lora.flops / lora.tokens)
    student = make_student(teacher, config.distill.student_layer_fraction, "teacher_layers", seed=0)
    measured = distillation_model_flops_per_token(student, teacher, config.distill.train.seq_len)
    assert measured == pytest.approx(distillation.flops / distillation.tokens)


def test_zero3_across_ranks_divides_the_model_state_but_not_the_activations():
    config = resolve_config("llama-1b")
    one = plan_training(config, vocab_size=50257)[0]
    sixteen = plan_training(config, vocab_size=50257, launch=LaunchConfig(num_nodes=2, gpus_per_node=8))[0]
    state_one = 16 * one.parameters / 1e9  # bf16 weights + grads + fp32 master and Adam moments
    assert sixteen.memory_gb_per_gpu == pytest.approx(one.memory_gb_per_gpu - state_one * 15 / 16, rel=1e-6)
    assert sixteen.tokens == 16 * one.tokens
    assert sixteen.gpu_hours == pytest.approx(16 * sixteen.hours)


def test_a_plan_over_the_accelerators_memory_is_refused_naming_the_stage_and_what_to_change():
    plans = plan_training(resolve_config("llama-1b"), vocab_size=50257)
    refuse_oversized(plans, Accelerator.named("H100"))
    with pytest.raises(ConfigError, match=r"pretrain: 23\.\d GB per GPU, over 21\.6 GB \(A10G 24 GB") as err:
        refuse_oversized(plans, Accelerator.named("A10G"))
    assert "grad_checkpointing" in str(err.value)


def test_plan_command_prints_every_training_stage_and_fails_on_an_oversized_plan():
    runner = CliRunner()
    ok = runner.invoke(app, ["plan", "--preset", "gpt2-124m", "--json"])
    assert ok.exit_code == 0, ok.output
    rows = json.loads(ok.stdout)
    assert [row["stage"] for row in rows] == ["pretrain", "finetune_lora", "distill"]
    assert rows[0]["parameters"] == 124_439_808
    refused = runner.invoke(app, ["plan", "--preset", "llama-1b", "--gpu", "A10G"], env={"COLUMNS": "80"})
    assert refused.exit_code != 0
    assert "A10G 24 GB less 10% headroom" in refused.output
    assert all(len(line) <= 80 for line in refused.output.splitlines() if not line.startswith("error:"))


def test_tensor_and_sequence_parallelism_split_a_llamas_activations():
    """Llama 3 8B's shape on 4 nodes × 8 GPUs with fsdp2, TP=8 × FSDP=4, no checkpointing: per layer and token
    4·h + 4·k + 4·i lies between the parallel matrices and 10·h (block and norm inputs, dropout masks) is split by
    sequence, so all of it is split 8 ways; the logits stay whole (the TP head gathers them); the model state is
    sharded over all 32 ranks."""
    vocab, d, layers, kv, mlp, seq, micro, ranks, tp = 128256, 4096, 32, 8 * 128, 14336, 8192, 1, 32, 8
    per_token_layer = (10 * d + 4 * d + 4 * kv + 4 * mlp) / tp
    config = resolve_config("llama-8b")
    train = config.pretrain.train.model_copy(
        update={
            "batch_size": micro,
            "grad_checkpointing": False,
            "distributed": DistributedConfig.model_validate({"backend": "fsdp2", "mesh": {"tensor_parallel": tp}}),
        }
    )
    config = config.model_copy(update={"pretrain": config.pretrain.model_copy(update={"train": train})})
    pretrain = plan_training(config, vocab_size=vocab, launch=LaunchConfig(num_nodes=4, gpus_per_node=8))[0]
    memory = 16 * pretrain.parameters / ranks + seq * micro * per_token_layer * layers + 8 * seq * micro * vocab
    assert layer_activation_bytes(config.pretrain.model, tp) == per_token_layer
    assert layer_activation_bytes(config.pretrain.model) == 14 * d + 4 * kv + 4 * mlp  # one rank: unchanged
    assert pretrain.memory_gb_per_gpu == pytest.approx(memory / 1e9, rel=1e-9)


@pytest.mark.parametrize(("schedule", "first_in_flight", "last_in_flight"), [("1f1b", 4, 1), ("gpipe", 8, 8)])
def test_pipeline_stages_plan_the_busiest_stage(schedule, first_in_flight, last_in_flight):
    """Llama 3 8B's shape on 4 nodes × 8 GPUs, 4 stages × FSDP=8, 8 micro-batches a step, no checkpointing: a
    stage holds 32 / 4 = 8 blocks and the embeddings (the last stage: the head, a copy of the tied embedding),
    sharded over its 8 ranks. The first stage keeps the activations of 4 micro-batches with 1F1B (one per stage in
    flight), all 8 with GPipe; the last stage the logits of one micro-batch with 1F1B, all 8 with GPipe."""
    vocab, d, layers, kv, mlp, seq, stages = 128256, 4096, 32, 8 * 128, 14336, 8192, 4
    mesh = {"pipeline_parallel": stages, "pipeline_schedule": schedule}
    config = resolve_config("llama-8b")
    train = config.pretrain.train.model_copy(
        update={
            "batch_size": 1,
            "grad_accum": 8,
            "grad_checkpointing": False,
            "distributed": DistributedConfig.model_validate({"backend": "fsdp2", "mesh": mesh}),
        }
    )
    config = config.model_copy(update={"pretrain": config.pretrain.model_copy(update={"train": train})})
    pretrain = plan_training(config, vocab_size=vocab, launch=LaunchConfig(num_nodes=4, gpus_per_node=8))[0]
    embeddings = vocab * d
    stage_parameters = (pretrain.parameters - embeddings) * 8 / layers + embeddings
    state = 16 * stage_parameters / 8
    per_layer = seq * (14 * d + 4 * kv + 4 * mlp)
    first = state + per_layer * 8 * first_in_flight
    last = state + per_layer * 8 * last_in_flight + 8 * seq * vocab * last_in_flight
    assert pretrain.memory_gb_per_gpu == pytest.approx(max(first, last) / 1e9, rel=1e-6)
    assert pretrain.tokens == train.max_steps * 8 * seq * 8  # 8 data-parallel ranks, 8 micro-batches of 1
