"""The fsdp2 mesh: degrees that do not multiply to the world size, or a tensor-parallel degree that does not
divide the model, are refused naming the field; every other config keeps its meaning."""

from __future__ import annotations

import pytest

from lmforge.config import LaunchConfig, TrainConfig
from lmforge.config.train import DistributedConfig, MeshConfig, tensor_parallel_problem
from lmforge.errors import ConfigError
from lmforge.plan import layer_activation_bytes, plan_training
from lmforge.stages import resolve_config
from lmforge.train.distributed import distributed_context

D = "pretrain.train.distributed"
TP = "train.distributed.mesh.tensor_parallel"
LLAMA = {"pretrain.model.arch": "llama", "pretrain.model.n_head": 4, "pretrain.model.n_embd": 64}
GPT2 = {"pretrain.model.n_head": 4, "pretrain.model.n_embd": 64}
FSDP2 = {f"{D}.backend": "fsdp2"}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({**LLAMA, **FSDP2, f"{D}.mesh.tensor_parallel": 3}, f"{TP} (3) must divide the model's attention heads (4)"),
        ({**LLAMA, **FSDP2, "pretrain.model.n_kv_head": 1, f"{D}.mesh.tensor_parallel": 2},
         f"{TP} (2) must divide the model's key/value heads (1)"),
        ({**LLAMA, **FSDP2, "pretrain.model.intermediate_size": 90, f"{D}.mesh.tensor_parallel": 4},
         f"{TP} (4) must divide the model's MLP width (90)"),
        ({**GPT2, **FSDP2, f"{D}.mesh.tensor_parallel": 3}, f"{TP} (3) must divide the model's attention heads (4)"),
        ({**GPT2, **FSDP2, "pretrain.model.intermediate_size": 90, f"{D}.mesh.tensor_parallel": 4},
         f"{TP} (4) must divide the model's MLP width (90)"),
        ({f"{D}.mesh.tensor_parallel": 2}, "mesh is set but backend is 'torch'; set backend: fsdp2"),
        ({**FSDP2, "pretrain.train.precision": "fp16"}, "train: Value error, precision fp16 needs loss scaling"),
        ({**FSDP2, f"{D}.mesh.data_parallel_shard": 0}, f"{D}.mesh.data_parallel_shard"),
        ({**FSDP2, f"{D}.mesh.pipeline_parallel": 2, "pretrain.train.grad_accum": 1},
         "grad_accum (1) must be at least distributed.mesh.pipeline_parallel (2)"),
        ({**FSDP2, f"{D}.mesh.pipeline_parallel": 3, "pretrain.train.grad_accum": 4, "pretrain.model.n_layer": 2},
         "train.distributed.mesh.pipeline_parallel (3) exceeds model.n_layer (2)"),
        ({"distill.train.distributed.backend": "fsdp2", "distill.train.distributed.mesh.pipeline_parallel": 2,
          "distill.train.grad_accum": 2}, "pipeline stages are for pretrain only"),
        ({"finetune_lora.train.distributed.backend": "fsdp2", "finetune_lora.train.grad_accum": 2,
          "finetune_lora.train.distributed.mesh.pipeline_parallel": 2}, "pipeline stages are for pretrain only"),
    ],
)  # fmt: skip
def test_mesh_that_cannot_split_the_model_is_refused_naming_the_field(overrides, expected):
    with pytest.raises(ConfigError) as err:
        resolve_config("tiny-cpu", overrides)
    assert expected in str(err.value)


@pytest.mark.parametrize("shape", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_mesh_that_divides_the_model_is_accepted(shape):
    cfg = resolve_config("tiny-cpu", {**shape, **FSDP2, f"{D}.mesh.tensor_parallel": 4})
    assert cfg.pretrain.train.distributed.mesh == MeshConfig(tensor_parallel=4)


def test_tensor_parallel_is_refused_for_an_architecture_without_a_plan():
    problem = tensor_parallel_problem(2, arch="mistral", heads=4, kv_heads=4, mlp_width=64)
    assert problem == (
        "distributed.mesh.tensor_parallel (2): llama and gpt2 only; mistral has no tensor-parallel plan (use "
        "tensor_parallel: 1 with data_parallel_shard)"
    )


@pytest.mark.parametrize(
    ("mesh", "world_size", "degrees"),
    [
        ({}, 4, (4, 1)),
        ({"tensor_parallel": 2}, 4, (2, 2)),
        ({"data_parallel_shard": 2, "tensor_parallel": 2}, 4, (2, 2)),
        ({"pipeline_parallel": 2}, 4, (2, 1)),
        ({"pipeline_parallel": 2, "tensor_parallel": 2}, 8, (2, 2)),
    ],
)
def test_mesh_degrees_fill_in_the_data_parallel_rest(mesh, world_size, degrees):
    assert MeshConfig.model_validate(mesh).degrees(world_size) == degrees


@pytest.mark.parametrize(
    ("mesh", "expected"),
    [
        ({"data_parallel_shard": 2, "tensor_parallel": 2}, "(1) × data_parallel_shard (2) × tensor_parallel (2)"),
        ({"tensor_parallel": 4}, "(1) × data_parallel_shard (null (the rest)) × tensor_parallel (4)"),
        ({"pipeline_parallel": 4}, "(4) × data_parallel_shard (null (the rest)) × tensor_parallel (1)"),
    ],
)
def test_mesh_whose_product_is_not_the_world_size_is_refused_at_backend_setup(monkeypatch, mesh, expected):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = DistributedConfig(backend="fsdp2", mesh=MeshConfig.model_validate(mesh))
    with pytest.raises(ConfigError) as err, distributed_context(cfg):
        pass
    assert str(err.value) == (
        f"distributed.mesh: pipeline_parallel {expected} must equal the world size, but WORLD_SIZE is 2; launch "
        "that many ranks or change the mesh"
    )


def test_plan_refuses_a_mesh_the_launch_does_not_fill():
    cfg = resolve_config("tiny-cpu", {**FSDP2, f"{D}.mesh.data_parallel_shard": 4})
    with pytest.raises(
        ConfigError,
        match=r"pretrain\.train\.distributed\.mesh: pipeline_parallel \(1\) × data_parallel_shard \(4\) "
        r".* WORLD_SIZE is 2",
    ):
        plan_training(cfg, vocab_size=512, launch=LaunchConfig(num_nodes=1, gpus_per_node=2))


def test_plan_counts_tokens_of_data_parallel_ranks_only_and_shards_the_state_over_all():
    tp = {**LLAMA, **FSDP2, f"{D}.mesh.tensor_parallel": 2}
    launch = LaunchConfig(num_nodes=1, gpus_per_node=4)
    ddp = plan_training(resolve_config("tiny-cpu", LLAMA), vocab_size=512, launch=launch)[0]
    fsdp_tp = plan_training(resolve_config("tiny-cpu", tp), vocab_size=512, launch=launch)[0]
    assert fsdp_tp.tokens * 2 == ddp.tokens
    state = 16 * ddp.parameters
    pretrain = resolve_config("tiny-cpu", tp).pretrain  # TP=2 also halves the activations (sequence parallel)
    split = layer_activation_bytes(pretrain.model) - layer_activation_bytes(pretrain.model, 2)
    layers = 1 if pretrain.train.grad_checkpointing else pretrain.model.n_layer
    activations = pretrain.train.seq_len * pretrain.train.batch_size * split * layers
    assert ddp.memory_gb_per_gpu - fsdp_tp.memory_gb_per_gpu == pytest.approx((state - state / 4 + activations) / 1e9)


def test_lora_refuses_tensor_parallel_whose_plan_cannot_split_the_adapted_layers():
    from lmforge.train.finetune_lora import check_backend

    mesh = MeshConfig(tensor_parallel=2)
    with pytest.raises(ConfigError, match=r"^finetune_lora\.train\.distributed\.mesh\.tensor_parallel \(2\): LoRA"):
        check_backend(TrainConfig(distributed=DistributedConfig(backend="fsdp2", mesh=mesh)))
    check_backend(TrainConfig(distributed=DistributedConfig(backend="fsdp2")))  # data_parallel_shard alone: allowed


def test_gpt2_activations_split_as_a_block_without_grouped_query_attention():
    """A GPT-2 block keeps 34·h per token; 24·h of it (Q, K and V at full width, the projection's input, the 4·h
    hidden layer) lies between its column- and row-parallel matrices."""
    gpt2 = resolve_config("tiny-cpu", GPT2).pretrain.model
    h = gpt2.n_embd
    assert layer_activation_bytes(gpt2) == 34 * h
    assert layer_activation_bytes(gpt2, 4) == 10 * h + 24 * h / 4
