"""Typed, validated configuration for every stage, and the presets shipped with the package.

All models are strict (no silent coercion: ``true`` is not an integer, ``"3"`` is not a number) and
forbid unknown keys. Each field carries a one-line description; the same text is shown as help in
the CLI (``lmforge config --explain``), in ``docs/config.md`` and in the pipeline's parameter
documentation in the Kubeflow UI.

One module per stage family (:mod:`~lmforge.config.data`, :mod:`~lmforge.config.train`,
:mod:`~lmforge.config.export`, :mod:`~lmforge.config.evaluate`, :mod:`~lmforge.config.launch`,
:mod:`~lmforge.config.serve`);
:mod:`~lmforge.config.presets` reads the presets. A preset is a YAML
file in ``lmforge/presets/`` holding one section per stage config; :mod:`lmforge.stages.configs` builds
the whole pipeline's config from the sections the stage registry declares and resolves presets with
overrides.
"""

from lmforge.config.base import (
    Precision,
    StrictModel,
    deep_merge,
    format_validation_error,
    parse_overrides,
    validate_config,
)
from lmforge.config.data import (
    C4Config,
    CleanConfig,
    FineWebConfig,
    GopherQualityConfig,
    GopherRepetitionConfig,
    LanguageIdConfig,
    NearDedupConfig,
    NGramFraction,
    PiiConfig,
    TokenizeConfig,
)
from lmforge.config.evaluate import GATE_CHECKS, EvaluateConfig, GateConfig, GenerationEvalConfig
from lmforge.config.export import ExportConfig, QuantizeConfig, TensorRTConfig
from lmforge.config.launch import LaunchConfig, SecretEnvConfig, SecretKeyRefConfig, TolerationConfig
from lmforge.config.presets import describe_preset, list_presets, load_preset
from lmforge.config.serve import ResourcesConfig, ServeConfig
from lmforge.config.train import (
    LORA_PRESETS,
    MIN_CHUNK_TOKENS,
    CheckpointConfig,
    ChunkLang,
    DeepSpeedConfig,
    DeepSpeedFp16Config,
    DistillConfig,
    DistributedConfig,
    LoraConfig,
    ModelConfig,
    PretrainConfig,
    TrainConfig,
    ZeroConfig,
)

__all__ = [
    "GATE_CHECKS",
    "LORA_PRESETS",
    "MIN_CHUNK_TOKENS",
    "C4Config",
    "CheckpointConfig",
    "ChunkLang",
    "CleanConfig",
    "DeepSpeedConfig",
    "DeepSpeedFp16Config",
    "DistillConfig",
    "DistributedConfig",
    "EvaluateConfig",
    "ExportConfig",
    "FineWebConfig",
    "GateConfig",
    "GenerationEvalConfig",
    "GopherQualityConfig",
    "GopherRepetitionConfig",
    "LanguageIdConfig",
    "LaunchConfig",
    "LoraConfig",
    "ModelConfig",
    "NGramFraction",
    "NearDedupConfig",
    "PiiConfig",
    "Precision",
    "PretrainConfig",
    "QuantizeConfig",
    "ResourcesConfig",
    "SecretEnvConfig",
    "SecretKeyRefConfig",
    "ServeConfig",
    "StrictModel",
    "TensorRTConfig",
    "TokenizeConfig",
    "TolerationConfig",
    "TrainConfig",
    "ZeroConfig",
    "deep_merge",
    "describe_preset",
    "format_validation_error",
    "list_presets",
    "load_preset",
    "parse_overrides",
    "validate_config",
]
