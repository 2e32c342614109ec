"""The whole pipeline's config and the presets shipped with the package (``lmforge/presets/*.yaml``)."""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml
from pydantic import Field

from lmforge.config.base import StrictModel, deep_merge, parse_overrides, validate_config
from lmforge.config.data import CleanConfig, TokenizeConfig
from lmforge.config.evaluate import EvaluateConfig, PromoteConfig
from lmforge.config.export import ExportConfig, QuantizeConfig, TensorRTConfig
from lmforge.config.train import DistillConfig, LoraConfig, PretrainConfig
from lmforge.errors import ConfigError


class PipelineConfig(StrictModel):
    """Every stage's configuration; what a preset file holds."""

    clean: CleanConfig = Field(default_factory=CleanConfig)
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig)
    finetune_lora: LoraConfig = Field(default_factory=LoraConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    export_onnx: ExportConfig = Field(default_factory=ExportConfig)
    quantize_int8: QuantizeConfig = Field(default_factory=QuantizeConfig)
    build_tensorrt: TensorRTConfig = Field(default_factory=TensorRTConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    promote: PromoteConfig = Field(default_factory=PromoteConfig)


STAGES: tuple[str, ...] = tuple(PipelineConfig.model_fields)


def list_presets() -> list[str]:
    """Names of the presets shipped with the package."""
    folder = resources.files("lmforge") / "presets"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_preset(name: str) -> dict[str, Any]:
    """Return the raw (unvalidated) mapping of preset ``name``."""
    if name not in list_presets():
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(list_presets())}")
    text = (resources.files("lmforge") / "presets" / f"{name}.yaml").read_text(encoding="utf-8")
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"preset {name!r}: top level must be a mapping")
    return data


def resolve_config(preset: str = "tiny-cpu", overrides: str | dict[str, Any] | None = None) -> PipelineConfig:
    """Preset merged with overrides (full-pipeline keys such as ``pretrain.train.lr``), validated."""
    return validate_config(PipelineConfig, deep_merge(load_preset(preset), parse_overrides(overrides)))


def resolve_stage_config(
    stage: str, preset: str = "tiny-cpu", overrides: str | dict[str, Any] | None = None
) -> StrictModel:
    """One stage's config: the preset's section for ``stage`` merged with stage-relative overrides."""
    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    section = load_preset(preset).get(stage, {})
    model = PipelineConfig.model_fields[stage].annotation
    return validate_config(model, deep_merge(section, parse_overrides(overrides)), prefix=stage)
