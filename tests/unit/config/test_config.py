"""Configs are strict: wrong types, unknown keys and inconsistent values are rejected, naming the field."""

import pytest

from lmforge.config import list_presets, parse_overrides
from lmforge.errors import ConfigError
from lmforge.stages import STAGES, PipelineConfig, resolve_config, resolve_stage_config, sections


@pytest.mark.parametrize("preset", ["tiny-cpu", "gpt2-124m"])
def test_shipped_presets_validate(preset):
    assert preset in list_presets()
    cfg = resolve_config(preset)
    assert isinstance(cfg, PipelineConfig)


def test_gpt2_124m_has_the_gpt2_small_shape():
    model = resolve_config("gpt2-124m").pretrain.model
    assert (model.n_layer, model.n_head, model.n_embd, model.block_size) == (12, 12, 768, 1024)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"pretrain.train.max_steps": True}, "pretrain.train.max_steps"),
        ({"pretrain.train.max_steps": "100"}, "pretrain.train.max_steps"),
        ({"pretrain.train.max_steps": -1}, "pretrain.train.max_steps"),
        ({"pretrain.train.lr": "3e-4"}, "pretrain.train.lr"),
        ({"pretrain.train.precision": "fp8"}, "pretrain.train.precision"),
        ({"pretrain.model.n_embd": 100, "pretrain.model.n_head": 3}, "n_embd (100) must be divisible"),
        ({"pretrain.train.seq_len": 4096}, "exceeds model.block_size"),
        ({"pretrain.train.min_lr": 1.0}, "min_lr"),
        ({"pretrain.trian.lr": 1e-3}, "pretrain.trian"),
        ({"distill.temperature": 0}, "distill.temperature"),
        ({"distill.alpha": 1.5}, "distill.alpha"),
        ({"tokenize.vocab_size": 10}, "tokenize.vocab_size"),
        ({"quantize_int8.op_types": ["Softmax"]}, "quantize_int8.op_types"),
        ({"build_tensorrt.min_seq": 512, "build_tensorrt.opt_seq": 64}, "min_seq <= opt_seq"),
        ({"promote.model_name": "x"}, "unknown config section(s) 'promote'"),
        ({"pretrian.train.lr": 1e-3}, "'pretrian' (did you mean 'pretrain'?)"),
        ({"clean.text_field": ""}, "clean.text_field"),
        ({"clean.max_bad_records": None}, "clean.max_bad_records"),
    ],
)
def test_invalid_values_are_rejected_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        resolve_config("tiny-cpu", overrides)
    assert field in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_preset_is_named():
    with pytest.raises(ConfigError, match="unknown preset 'gpt5'"):
        resolve_config("gpt5")


def test_stage_overrides_merge_over_the_preset():
    cfg = resolve_stage_config("pretrain", "tiny-cpu", '{"train.max_steps": 40}')
    assert cfg.train.max_steps == 40
    assert cfg.model.n_layer == resolve_config("tiny-cpu").pretrain.model.n_layer


def test_stage_overrides_must_be_a_json_object():
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_overrides("{max_steps: 3")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        parse_overrides("[1, 2]")


def test_the_pipeline_config_has_one_section_per_stage_config_and_stages_without_one_take_no_overrides():
    assert (
        set(PipelineConfig.model_fields) == {spec.section for spec in STAGES.values() if spec.config} == set(sections())
    )
    assert {name for name, spec in STAGES.items() if spec.config is None} == {"preflight", "plan_shards", "promote"}
    assert resolve_stage_config("clean_shard").model_dump() == resolve_stage_config("clean").model_dump()
    assert resolve_stage_config("promote") is None
    with pytest.raises(ConfigError, match="takes no config"):
        resolve_stage_config("promote", overrides={"model_name": "x"})
    with pytest.raises(ConfigError, match=r"unknown stage 'pretrian' \(did you mean 'pretrain'\?\)"):
        resolve_stage_config("pretrian")


def test_an_unknown_field_names_the_nearest_valid_one_at_its_level():
    with pytest.raises(ConfigError) as info:
        resolve_config("tiny-cpu", {"clean.text_fild": "x", "evaluate.gate.max_latency": 3, "pretrain.trian.lr": 1})
    message = str(info.value)
    assert "clean.text_fild: Extra inputs are not permitted (got 'x') (did you mean 'text_field'?)" in message
    assert (
        "evaluate.gate.max_latency: Extra inputs are not permitted (got 3) (did you mean 'max_latency_ms'?)" in message
    )
    assert "pretrain.trian: Extra inputs are not permitted (got {'lr': 1}) (did you mean 'train'?)" in message


def test_an_unknown_field_with_no_near_name_gets_no_suggestion():
    with pytest.raises(ConfigError) as info:
        resolve_stage_config("pretrain", "tiny-cpu", {"train.zzzz": 1})
    assert str(info.value).endswith("pretrain.train.zzzz: Extra inputs are not permitted (got 1)")
