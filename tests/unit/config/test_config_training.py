"""Training configs are strict: each bad value is rejected naming its field; DeepSpeed JSON comes from them."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from lmforge.config import TrainConfig
from lmforge.errors import ConfigError
from lmforge.stages import resolve_config
from lmforge.train.deepspeed_config import DeepSpeedJSON, deepspeed_json

T = "pretrain.train"
D = "pretrain.train.distributed"
Z = "pretrain.train.distributed.deepspeed.zero"
C = "pretrain.train.checkpoint"
M = "pretrain.model"
DS = {f"{D}.backend": "deepspeed"}
ZERO3 = {**DS, f"{Z}.stage": 3}

INVALID = [
    # wrong types: strict, nothing coerced
    ({f"{T}.batch_size": 8.0}, f"{T}.batch_size"),
    ({f"{T}.grad_accum": "2"}, f"{T}.grad_accum"),
    ({f"{T}.grad_checkpointing": "yes"}, f"{T}.grad_checkpointing"),
    ({f"{T}.grad_checkpointing": 1}, f"{T}.grad_checkpointing"),
    ({f"{T}.tf32": "true"}, f"{T}.tf32"),
    ({f"{T}.max_bad_steps": True}, f"{T}.max_bad_steps"),
    ({f"{T}.peak_flops": "989e12"}, f"{T}.peak_flops"),
    ({**DS, f"{Z}.reduce_bucket_size": True}, f"{Z}.reduce_bucket_size"),
    ({**DS, f"{Z}.reduce_bucket_size": 5e8}, f"{Z}.reduce_bucket_size"),
    ({**DS, f"{Z}.allgather_bucket_size": "auto"}, f"{Z}.allgather_bucket_size"),
    ({**DS, f"{Z}.stage": True}, f"{Z}.stage"),
    ({**DS, f"{Z}.stage": "3"}, f"{Z}.stage"),
    ({**DS, f"{Z}.overlap_comm": "false"}, f"{Z}.overlap_comm"),
    ({f"{C}.every_steps": 10.5}, f"{C}.every_steps"),
    ({f"{C}.keep_last": None}, f"{C}.keep_last"),
    ({f"{C}.dir": 42}, f"{C}.dir"),
    ({f"{D}.timeout_minutes": "30"}, f"{D}.timeout_minutes"),
    # out-of-range sizes
    ({f"{T}.batch_size": 0}, f"{T}.batch_size"),
    ({f"{T}.grad_accum": -1}, f"{T}.grad_accum"),
    ({f"{T}.max_bad_steps": 0}, f"{T}.max_bad_steps"),
    ({f"{T}.peak_flops": -1.0}, f"{T}.peak_flops"),
    ({f"{C}.every_steps": -5}, f"{C}.every_steps"),
    ({f"{C}.every_minutes": -1.0}, f"{C}.every_minutes"),
    ({f"{C}.keep_last": 0}, f"{C}.keep_last"),
    ({**DS, f"{Z}.stage": 4}, f"{Z}.stage"),
    ({**DS, f"{Z}.reduce_bucket_size": 0}, f"{Z}.reduce_bucket_size"),
    ({**DS, f"{Z}.reduce_bucket_size": -100}, f"{Z}.reduce_bucket_size"),
    ({**ZERO3, f"{Z}.stage3_max_live_parameters": 0}, f"{Z}.stage3_max_live_parameters"),
    ({f"{D}.timeout_minutes": 0.0}, f"{D}.timeout_minutes"),
    ({f"{D}.deepspeed.fp16.initial_scale_power": 40, f"{T}.precision": "fp16", **DS}, "initial_scale_power"),
    # inconsistent combinations
    ({f"{T}.precision": "bf16", **DS, f"{D}.deepspeed.fp16.hysteresis": 2}, "fp16 and bf16 never together"),
    ({**ZERO3, f"{T}.compile": True}, f"{T}: Value error, compile"),
    ({**DS, f"{Z}.stage": 2, f"{Z}.offload_param": "cpu"}, "offload_param needs stage 3"),
    ({**DS, f"{Z}.stage": 1, f"{Z}.stage3_prefetch_bucket_size": 1000}, "stage3_prefetch_bucket_size apply to"),
    ({**DS, f"{Z}.stage": 0, f"{Z}.offload_optimizer": "cpu"}, "offload_optimizer needs stage >= 1"),
    ({f"{D}.deepspeed.zero.stage": 3}, "backend is 'torch'"),
    ({f"{C}.dir": "s3://"}, "has no bucket"),
    ({f"{C}.dir": "/ckpt", f"{C}.every_minutes": 0.0, f"{C}.on_sigterm": False}, "nothing is saved"),
    ({f"{C}.dir": ""}, f"{C}.dir"),
    ({f"{M}.n_kv_head": 2}, f"{M}: Value error, n_kv_head: llama only, but arch is gpt2"),
    ({f"{M}.rope_theta": 500000.0}, f"{M}: Value error, rope_theta: llama only"),
    ({f"{M}.arch": "llama", f"{M}.n_kv_head": 3}, "n_kv_head (3) must divide n_head (4)"),
    ({f"{M}.intermediate_size": 0}, f"{M}.intermediate_size"),
    # closed choices
    ({f"{D}.backend": "horovod"}, f"{D}.backend"),
    ({f"{D}.process_group": "mpi"}, f"{D}.process_group"),
    ({f"{C}.resume": "latest"}, f"{C}.resume"),
    ({**DS, f"{Z}.offload_optimizer": "gpu"}, f"{Z}.offload_optimizer"),
    # unknown keys
    ({f"{T}.gradient_checkpointing": True}, f"{T}.gradient_checkpointing"),
    ({f"{C}.every_n_steps": 10}, f"{C}.every_n_steps"),
    ({**DS, f"{Z}.stage3_gather_fp16_weights": True}, f"{Z}.stage3_gather_fp16_weights"),
    ({f"{D}.deepspeed.bf16": {"enabled": True}}, f"{D}.deepspeed.bf16"),
]


def test_at_least_thirty_invalid_training_configs_are_covered():
    assert len(INVALID) >= 30


@pytest.mark.parametrize(("overrides", "field"), INVALID, ids=[str(i) for i in range(len(INVALID))])
def test_invalid_training_config_is_rejected_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        resolve_config("tiny-cpu", overrides)
    message = str(err.value)
    assert field in message, message
    assert "\n" not in message


def test_valid_training_options_are_accepted():
    cfg = resolve_config(
        "tiny-cpu",
        {
            f"{T}.grad_checkpointing": True,
            f"{C}.dir": "s3://bucket/run-1/ckpt",
            f"{C}.every_steps": 100,
            **ZERO3,
            f"{Z}.stage3_prefetch_bucket_size": 1000,
            f"{Z}.offload_param": "cpu",
        },
    )
    assert cfg.pretrain.train.distributed.deepspeed.zero.stage == 3


def _ds(**overrides) -> TrainConfig:
    data = {"batch_size": 4, "grad_accum": 2, "precision": "bf16", "distributed": {"backend": "deepspeed"}}
    for key, value in overrides.items():
        data = {**data, key: value}
    return TrainConfig.model_validate(data)


def test_deepspeed_json_keeps_integers_and_the_batch_identity():
    cfg = _ds(distributed={"backend": "deepspeed", "deepspeed": {"zero": {"stage": 3, "reduce_bucket_size": 12345}}})
    config = deepspeed_json(cfg, world_size=4)
    assert config["train_batch_size"] == 4 * 2 * 4
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["gradient_accumulation_steps"] == 2
    assert config["zero_optimization"]["reduce_bucket_size"] == 12345
    assert type(config["zero_optimization"]["reduce_bucket_size"]) is int
    assert config["bf16"] == {"enabled": True} and "fp16" not in config
    assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert "allgather_bucket_size" not in config["zero_optimization"]  # a stage 1/2 key
    assert json.loads(json.dumps(config)) == config


def test_deepspeed_json_for_stage_1_has_no_stage3_keys_and_fp32_no_precision_section():
    config = deepspeed_json(_ds(precision="fp32"), world_size=2)
    assert config["zero_optimization"]["stage"] == 2
    assert not any(k.startswith("stage3_") for k in config["zero_optimization"])
    assert "bf16" not in config and "fp16" not in config


def test_deepspeed_json_fp16_carries_loss_scaling_options():
    cfg = _ds(
        precision="fp16",
        distributed={"backend": "deepspeed", "deepspeed": {"fp16": {"initial_scale_power": 12}}},
    )
    assert deepspeed_json(cfg, 1)["fp16"] == {
        "enabled": True, "loss_scale": 0.0, "initial_scale_power": 12, "loss_scale_window": 1000,
        "hysteresis": 2, "min_loss_scale": 1.0,
    }  # fmt: skip


BASE_JSON = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "zero_optimization": {
        "stage": 2, "overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": True,
        "reduce_bucket_size": 100,
    },
}  # fmt: skip


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"zero_optimization": {**BASE_JSON["zero_optimization"], "reduce_bucket_size": True}}, "reduce_bucket_size"),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "bf16 and fp16 are both enabled"),
        ({"train_batch_size": 7}, "not a multiple of micro batch"),
        ({"zero_optimization": {**BASE_JSON["zero_optimization"], "stage3_max_live_parameters": 10}}, "need stage 3"),
        ({"gradient_accumulation_steps": "1"}, "gradient_accumulation_steps"),
        ({"optimizer": {"type": "AdamW"}}, "optimizer"),
    ],
)
def test_hand_written_deepspeed_json_is_validated(patch, field):
    with pytest.raises(ValidationError) as err:
        DeepSpeedJSON.model_validate({**BASE_JSON, **patch})
    assert field in str(err.value)


@pytest.mark.parametrize("overrides", [{}, ZERO3, {**DS, f"{Z}.stage": 1}, {f"{C}.dir": "s3://b/c"}])
def test_a_dumped_training_config_validates_again(overrides):
    cfg = resolve_config("tiny-cpu", overrides).pretrain
    assert type(cfg).model_validate_json(cfg.model_dump_json()) == cfg
    assert type(cfg).model_validate(cfg.model_dump(mode="json")) == cfg
