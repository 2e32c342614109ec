"""Typed, validated configuration for every stage, and the presets shipped with the package.

All models are strict (no silent coercion: ``true`` is not an integer, ``"3"`` is not a number) and
forbid unknown keys. Each field carries a one-line description; the same text is shown as help in
the CLI (``lmforge config --explain``), in ``docs/config.md`` and in the pipeline's parameter
documentation in the Kubeflow UI.

One module per stage family (:mod:`~lmforge.config.data`, :mod:`~lmforge.config.train`,
:mod:`~lmforge.config.export`, :mod:`~lmforge.config.evaluate`, :mod:`~lmforge.config.launch`);
:mod:`~lmforge.config.presets` holds the whole pipeline's config and the presets. A preset is a YAML
file in ``lmforge/presets/`` holding a partial :class:`PipelineConfig`; :func:`resolve_config` merges
a preset with user overrides and validates the result.
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
from lmforge.config.evaluate import EvaluateConfig, GateConfig, GenerationEvalConfig, PromoteConfig
from lmforge.config.export import ExportConfig, QuantizeConfig, TensorRTConfig
from lmforge.config.launch import LaunchConfig, SecretEnvConfig, TolerationConfig
from lmforge.config.presets import (
    STAGES,
    PipelineConfig,
    list_presets,
    load_preset,
    resolve_config,
    resolve_stage_config,
)
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
    "LORA_PRESETS",
    "MIN_CHUNK_TOKENS",
    "STAGES",
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
    "PipelineConfig",
    "Precision",
    "PretrainConfig",
    "PromoteConfig",
    "QuantizeConfig",
    "SecretEnvConfig",
    "StrictModel",
    "TensorRTConfig",
    "TokenizeConfig",
    "TolerationConfig",
    "TrainConfig",
    "ZeroConfig",
    "deep_merge",
    "format_validation_error",
    "list_presets",
    "load_preset",
    "parse_overrides",
    "resolve_config",
    "resolve_stage_config",
    "validate_config",
]
