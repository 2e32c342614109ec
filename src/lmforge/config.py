"""Typed, validated configuration for every stage, and the presets shipped with the package.

All models are strict (no silent coercion: ``true`` is not an integer, ``"3"`` is not a number) and
forbid unknown keys. Each field carries a one-line description; the same text is shown as help in
the CLI and in the pipeline's parameter documentation.

A preset is a YAML file in ``lmforge/presets/`` holding a partial :class:`PipelineConfig`;
:func:`resolve_config` merges a preset with user overrides and validates the result.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lmforge.errors import ConfigError

Precision = Literal["fp32", "bf16", "fp16"]


class StrictModel(BaseModel):
    """Base for all configs: strict types, unknown keys rejected, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, validate_default=True)


class LanguageIdConfig(StrictModel):
    """Language identification (lingua): keep documents in the allowed languages only."""

    enabled: bool = Field(True, description="Detect each document's language and drop disallowed ones.")
    allowed: list[str] = Field(
        default_factory=lambda: ["en", "zh"],
        min_length=1,
        description="ISO 639-1 codes of the languages to keep (lingua supports 75).",
    )
    min_confidence: float = Field(
        0.65, ge=0.0, le=1.0, description="Drop a document whose top language confidence is below this."
    )
    candidates: list[str] | None = Field(
        default_factory=lambda: [
            "en",
            "zh",
            "de",
            "fr",
            "es",
            "it",
            "pt",
            "nl",
            "sv",
            "da",
            "nb",
            "pl",
            "cs",
            "ru",
            "uk",
            "tr",
            "ar",
            "fa",
            "hi",
            "ja",
            "ko",
            "vi",
            "id",
            "la",
            "el",
            "fi",
            "hu",
            "ro",
        ],
        description="Languages the detector chooses among (plus the allowed ones); null means all 75 "
        "lingua languages (about 3x slower).",
    )
    sample_chars: int = Field(
        1000, gt=0, description="Characters from the start of a document given to the detector (speed)."
    )


class GopherQualityConfig(StrictModel):
    """Gopher quality rules (Rae et al. 2021, as in datatrove/FineWeb); a bound of null disables it."""

    enabled: bool = Field(True, description="Apply the Gopher quality rules.")
    languages: list[str] = Field(
        default_factory=lambda: ["en"], description="Apply only to documents detected as these languages."
    )
    min_doc_words: int | None = Field(50, ge=0, description="Drop documents with fewer words.")
    max_doc_words: int | None = Field(100_000, ge=0, description="Drop documents with more words.")
    min_avg_word_length: float | None = Field(3.0, ge=0.0, description="Drop if mean word length is below.")
    max_avg_word_length: float | None = Field(10.0, ge=0.0, description="Drop if mean word length is above.")
    max_symbol_word_ratio: float | None = Field(
        0.1, ge=0.0, description="Drop if ('#' + ellipsis) count per word exceeds this."
    )
    max_bullet_lines_ratio: float | None = Field(
        0.9, ge=0.0, le=1.0, description="Drop if more lines than this start with a bullet."
    )
    max_ellipsis_lines_ratio: float | None = Field(
        0.3, ge=0.0, le=1.0, description="Drop if more lines than this end with an ellipsis."
    )
    max_non_alpha_words_ratio: float | None = Field(
        0.8,
        ge=0.0,
        le=1.0,
        description="Drop if the fraction of words holding an alphabetic character is below this "
        "(datatrove's name for the rule).",
    )
    min_stop_words: int | None = Field(2, ge=0, description="Drop if fewer stop words than this occur.")
    stop_words: list[str] = Field(
        default_factory=lambda: ["the", "be", "to", "of", "and", "that", "have", "with"],
        description="Stop words counted by min_stop_words.",
    )


class NGramFraction(StrictModel):
    """A word n-gram size and the largest share of characters it may cover."""

    n: int = Field(gt=0, description="N-gram size in words.")
    max_fraction: float = Field(ge=0.0, le=1.0, description="Largest fraction of characters allowed.")


def _ngram_fractions(pairs: list[tuple[int, float]]) -> list[NGramFraction]:
    return [NGramFraction(n=n, max_fraction=f) for n, f in pairs]


class GopherRepetitionConfig(StrictModel):
    """Gopher repetition rules (duplicate lines, paragraphs and n-grams); a bound of null disables it."""

    enabled: bool = Field(True, description="Apply the Gopher repetition rules.")
    languages: list[str] = Field(
        default_factory=lambda: ["en"], description="Apply only to documents detected as these languages."
    )
    dup_line_frac: float | None = Field(0.3, ge=0.0, le=1.0, description="Max fraction of duplicated lines.")
    dup_para_frac: float | None = Field(0.3, ge=0.0, le=1.0, description="Max fraction of duplicated paragraphs.")
    dup_line_char_frac: float | None = Field(
        0.2, ge=0.0, le=1.0, description="Max fraction of characters in duplicated lines."
    )
    dup_para_char_frac: float | None = Field(
        0.2, ge=0.0, le=1.0, description="Max fraction of characters in duplicated paragraphs."
    )
    top_n_grams: list[NGramFraction] = Field(
        default_factory=lambda: _ngram_fractions([(2, 0.2), (3, 0.18), (4, 0.16)]),
        description="Max character share of the most frequent word n-gram, per n.",
    )
    dup_n_grams: list[NGramFraction] = Field(
        default_factory=lambda: _ngram_fractions([(5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10)]),
        description="Max character share of all duplicated word n-grams, per n.",
    )


class C4Config(StrictModel):
    """C4 rules (Raffel et al. 2020) with FineWeb's choice: terminal-punctuation line filter off."""

    enabled: bool = Field(True, description="Apply the C4 rules.")
    languages: list[str] = Field(
        default_factory=lambda: ["en"], description="Apply only to documents detected as these languages."
    )
    remove_citations: bool = Field(True, description="Delete Wikipedia-style citation marks like [1], [edit].")
    filter_no_terminal_punct: bool = Field(
        False, description="Drop lines not ending in terminal punctuation (C4: on; FineWeb: off)."
    )
    min_words_per_line: int = Field(3, ge=0, description="Drop lines with fewer words (0 disables).")
    max_word_length: int = Field(1000, gt=0, description="Drop lines holding a longer word.")
    filter_javascript: bool = Field(True, description="Drop lines mentioning 'javascript'.")
    filter_policy: bool = Field(True, description="Drop lines with cookie/privacy/terms-of-use boilerplate.")
    filter_lorem_ipsum: bool = Field(True, description="Drop documents containing 'lorem ipsum'.")
    filter_curly_bracket: bool = Field(True, description="Drop documents containing '{' (code).")
    min_num_sentences: int = Field(5, ge=0, description="Drop documents with fewer sentences after line removal.")


class FineWebConfig(StrictModel):
    """FineWeb's extra line-level rules (Penedo et al. 2024)."""

    enabled: bool = Field(True, description="Apply the FineWeb rules.")
    languages: list[str] = Field(
        default_factory=lambda: ["en"], description="Apply only to documents detected as these languages."
    )
    line_punct_thr: float | None = Field(
        0.12, ge=0.0, le=1.0, description="Drop if fewer lines than this fraction end in terminal punctuation."
    )
    line_punct_exclude_zero: bool = Field(False, description="Exempt documents where no line ends in punctuation.")
    short_line_thr: float | None = Field(
        0.67, ge=0.0, le=1.0, description="Drop if more lines than this fraction are short."
    )
    short_line_length: int = Field(30, ge=0, description="A line of at most this many characters is short.")
    char_duplicates_ratio: float | None = Field(
        0.01, ge=0.0, le=1.0, description="Max fraction of characters in duplicated lines."
    )
    new_line_ratio: float | None = Field(0.3, ge=0.0, description="Max newlines per word.")


class PiiConfig(StrictModel):
    """PII redaction: matches are replaced by typed placeholders and counted."""

    enabled: bool = Field(True, description="Redact PII.")
    email: bool = Field(True, description="Redact e-mail addresses as <EMAIL>.")
    phone: bool = Field(True, description="Redact phone numbers as <PHONE>.")
    ip: bool = Field(True, description="Redact IPv4 and IPv6 addresses as <IP_ADDRESS>.")
    card: bool = Field(True, description="Redact Luhn-valid 13-19 digit card numbers as <CARD_NUMBER>.")


class NearDedupConfig(StrictModel):
    """MinHash LSH near-duplicate removal; one document per cluster (the earliest in the corpus) is kept."""

    enabled: bool = Field(True, description="Remove near duplicates.")
    ngram: int = Field(5, gt=0, description="Shingle size in words.")
    bands: int = Field(14, gt=0, description="LSH bands; documents sharing any band bucket are candidates.")
    rows: int = Field(8, gt=0, description="MinHash rows per band (bands x rows permutations in all).")
    min_similarity: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Confirm a candidate pair only when its signature agreement (Jaccard estimate) reaches "
        "this; 0 accepts every LSH candidate as FineWeb does.",
    )
    seed: int = Field(1, ge=0, description="Seed of the MinHash permutations.")


class CleanConfig(StrictModel):
    """Rules of the ``clean`` stage."""

    text_field: str = Field("text", min_length=1, description="JSON field that holds a document's text.")
    unicode_form: Literal["NFC", "NFKC"] = Field("NFC", description="Unicode normalization form.")
    min_chars: int = Field(20, ge=0, description="Drop documents shorter than this many characters.")
    min_words: int = Field(3, ge=0, description="Drop documents with fewer words than this.")
    exact_dedup: bool = Field(True, description="Drop exact duplicates of normalized text (keep the first).")
    language: LanguageIdConfig = Field(default_factory=LanguageIdConfig, description="Language identification.")
    gopher_repetition: GopherRepetitionConfig = Field(
        default_factory=GopherRepetitionConfig, description="Gopher repetition rules."
    )
    gopher_quality: GopherQualityConfig = Field(
        default_factory=GopherQualityConfig, description="Gopher quality rules."
    )
    c4: C4Config = Field(default_factory=C4Config, description="C4 rules.")
    fineweb: FineWebConfig = Field(default_factory=FineWebConfig, description="FineWeb line rules.")
    pii: PiiConfig = Field(default_factory=PiiConfig, description="PII redaction.")
    near_dedup: NearDedupConfig = Field(default_factory=NearDedupConfig, description="MinHash LSH dedup.")
    shard_docs: int = Field(50_000, gt=0, description="Documents per output Parquet shard.")
    quarantine_samples: int = Field(100, ge=0, description="Rejected documents kept per rule for review.")
    max_bad_records: int = Field(
        0,
        ge=0,
        description="Malformed records (bad JSON, missing text) tolerated and counted; one more fails the "
        "stage with an error naming file and line.",
    )


class TokenizeConfig(StrictModel):
    """Tokenizer training and token-shard packing."""

    vocab_size: int = Field(4096, ge=260, le=1_000_000, description="Byte-level BPE vocabulary size.")
    min_frequency: int = Field(2, ge=1, description="Minimum pair frequency for a BPE merge.")
    val_fraction: float = Field(
        0.05, gt=0.0, lt=1.0, description="Fraction of documents held out for validation (by id hash)."
    )
    shard_tokens: int = Field(50_000_000, gt=0, description="Maximum tokens per shard file before a new one starts.")
    eos_token: str = Field("<|endoftext|>", min_length=1, description="End-of-document token.")
    pad_token: str = Field("<|pad|>", min_length=1, description="Padding token.")


class ModelConfig(StrictModel):
    """Shape of a decoder-only transformer."""

    arch: Literal["gpt2", "llama"] = Field("gpt2", description="Architecture family (transformers class).")
    n_layer: int = Field(2, gt=0, description="Number of transformer blocks.")
    n_head: int = Field(2, gt=0, description="Attention heads per block.")
    n_embd: int = Field(64, gt=0, description="Hidden size.")
    block_size: int = Field(128, gt=0, description="Context length (maximum positions).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on residuals, attention and embeddings.")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        return self


class TrainConfig(StrictModel):
    """Optimizer, schedule and loop settings shared by pretraining, fine-tuning and distillation."""

    max_steps: int = Field(200, gt=0, description="Optimizer steps.")
    batch_size: int = Field(8, gt=0, description="Sequences per micro-batch.")
    grad_accum: int = Field(1, gt=0, description="Micro-batches accumulated per optimizer step.")
    seq_len: int = Field(128, gt=1, description="Tokens per training sequence (≤ the model's block size).")
    lr: float = Field(3e-3, gt=0.0, description="Peak learning rate.")
    min_lr: float = Field(3e-4, ge=0.0, description="Learning rate at the end of cosine decay.")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(0.1, ge=0.0, description="AdamW weight decay (not applied to norms/biases).")
    beta1: float = Field(0.9, gt=0.0, lt=1.0, description="AdamW beta1.")
    beta2: float = Field(0.95, gt=0.0, lt=1.0, description="AdamW beta2.")
    grad_clip: float = Field(1.0, ge=0.0, description="Clip the global gradient norm to this (0 disables).")
    precision: Precision = Field("bf16", description="Autocast dtype: fp32, bf16 or fp16 (GradScaler).")
    seed: int = Field(1337, ge=0, description="Random seed for initialization and batch sampling.")
    eval_interval: int = Field(50, gt=0, description="Evaluate on the validation split every N steps.")
    eval_batches: int = Field(4, gt=0, description="Validation micro-batches per evaluation.")
    log_interval: int = Field(10, gt=0, description="Log loss and throughput every N steps.")

    @model_validator(mode="after")
    def _check_schedule(self) -> TrainConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        if self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must not exceed max_steps ({self.max_steps})")
        return self


class PretrainConfig(StrictModel):
    """The ``pretrain`` stage: model shape and training loop."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="Model shape.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training loop.")

    @model_validator(mode="after")
    def _seq_fits_model(self) -> PretrainConfig:
        if self.train.seq_len > self.model.block_size:
            raise ValueError(f"train.seq_len ({self.train.seq_len}) exceeds model.block_size ({self.model.block_size})")
        return self


class LoraConfig(StrictModel):
    """The ``finetune_lora`` stage (peft LoRA on prompt/response pairs)."""

    r: int = Field(8, gt=0, description="LoRA rank.")
    alpha: int = Field(16, gt=0, description="LoRA alpha; the update is scaled by alpha/r.")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the LoRA branch.")
    target_modules: list[str] | None = Field(
        None, description="Module names to adapt; null picks the architecture's attention/MLP projections."
    )
    heldout_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="Fraction of Q&A pairs held out for eval loss (by hash)."
    )
    train: TrainConfig = Field(
        default_factory=lambda: TrainConfig(max_steps=60, lr=2e-3, min_lr=2e-4, warmup_steps=5),
        description="Training loop.",
    )


class DistillConfig(StrictModel):
    """The ``distill`` stage: student shape and the KD loss."""

    student_layer_fraction: float = Field(
        0.5, gt=0.0, le=1.0, description="Student depth as a fraction of the teacher's layers."
    )
    init: Literal["teacher_layers", "random"] = Field(
        "teacher_layers",
        description="Initialize from every k-th teacher layer (DistilBERT-style) or randomly.",
    )
    temperature: float = Field(2.0, gt=0.0, description="Softmax temperature T for the KL term.")
    alpha: float = Field(0.5, ge=0.0, le=1.0, description="Weight of the T²·KL term; CE gets 1 − alpha.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training loop.")


class ExportConfig(StrictModel):
    """The ``export_onnx`` stage."""

    opset: int = Field(18, ge=17, le=23, description="ONNX opset version.")
    parity_tolerance: float = Field(
        1e-3, gt=0.0, description="Maximum |logit| difference allowed between ONNX Runtime and PyTorch."
    )


class QuantizeConfig(StrictModel):
    """The ``quantize_int8`` stage."""

    calibration_sequences: int = Field(128, gt=0, description="Calibration sequences drawn from token shards.")
    calibration_seq_len: int = Field(64, gt=1, description="Tokens per calibration sequence.")
    calibrate_method: Literal["minmax", "entropy", "percentile"] = Field(
        "minmax", description="Static calibration method for the Q/DQ model."
    )
    op_types: list[Literal["MatMul", "Gemm", "Conv", "Add", "Mul"]] = Field(
        default_factory=lambda: ["MatMul", "Gemm"], min_length=1, description="ONNX op types to quantize."
    )
    per_channel: bool = Field(True, description="Per-channel weight scales in the Q/DQ model.")


class TensorRTConfig(StrictModel):
    """The ``build_tensorrt`` stage (needs a GPU and the tensorrt package)."""

    precision: Literal["int8", "fp16", "fp32"] = Field("int8", description="Engine precision.")
    min_batch: int = Field(1, gt=0, description="Optimization profile: minimum batch.")
    opt_batch: int = Field(4, gt=0, description="Optimization profile: optimal batch.")
    max_batch: int = Field(8, gt=0, description="Optimization profile: maximum batch.")
    min_seq: int = Field(1, gt=0, description="Optimization profile: minimum sequence length.")
    opt_seq: int = Field(64, gt=0, description="Optimization profile: optimal sequence length.")
    max_seq: int = Field(128, gt=0, description="Optimization profile: maximum sequence length.")
    workspace_gib: float = Field(4.0, gt=0.0, description="Builder workspace limit in GiB.")

    @model_validator(mode="after")
    def _ordered_profiles(self) -> TensorRTConfig:
        if not self.min_batch <= self.opt_batch <= self.max_batch:
            raise ValueError("profile batch sizes must satisfy min_batch <= opt_batch <= max_batch")
        if not self.min_seq <= self.opt_seq <= self.max_seq:
            raise ValueError("profile sequence lengths must satisfy min_seq <= opt_seq <= max_seq")
        return self


class GateConfig(StrictModel):
    """Thresholds the candidate must meet to be promoted."""

    max_student_perplexity: float = Field(
        1e4, gt=0.0, description="Fail when the student's held-out perplexity is above this."
    )
    max_int8_perplexity_delta: float = Field(
        0.05,
        ge=0.0,
        description="Fail when INT8 perplexity exceeds FP32 ONNX perplexity by more than this fraction.",
    )
    max_latency_ms: float = Field(
        1e4, gt=0.0, description="Fail when the served model's p99 forward latency (batch 1) exceeds this."
    )


class EvaluateConfig(StrictModel):
    """The ``evaluate`` stage."""

    context: int = Field(128, gt=1, description="Window length for perplexity.")
    max_eval_tokens: int = Field(20_000, gt=0, description="Held-out tokens scored per model.")
    latency_runs: int = Field(20, gt=0, description="Timed forward passes per model (after warm-up).")
    gate: GateConfig = Field(default_factory=GateConfig, description="Promotion thresholds.")


class PromoteConfig(StrictModel):
    """The ``promote`` stage."""

    model_name: str = Field(
        "lmforge-demo", pattern=r"^[a-z0-9][a-z0-9._-]*$", description="Release name in the registry."
    )


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


T = TypeVar("T", bound=StrictModel)

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


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Merge ``override`` into a copy of ``base``; nested mappings merge, other values replace."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def parse_overrides(overrides: str | dict[str, Any] | None) -> dict[str, Any]:
    """Accept overrides as a mapping or a JSON object string; dotted keys nest (``"train.lr": 1e-3``)."""
    if overrides is None or overrides == "":
        return {}
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"overrides are not valid JSON: {exc.msg} at char {exc.pos}") from exc
    if not isinstance(overrides, dict):
        raise ConfigError(f"overrides must be a JSON object, got {type(overrides).__name__}")
    nested: dict[str, Any] = {}
    for key, value in overrides.items():
        parts = key.split(".")
        leaf: dict[str, Any] = {parts[-1]: value}
        for part in reversed(parts[:-1]):
            leaf = {part: leaf}
        nested = deep_merge(nested, leaf)
    return nested


def format_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """One line per problem: ``field.path: message (got value)``."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        got = "" if err["type"] == "missing" else f" (got {err.get('input')!r:.60})"
        lines.append(f"{loc or '<root>'}: {err['msg']}{got}")
    return "; ".join(lines)


def validate_config(model: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Validate ``data`` as ``model``; raise :class:`ConfigError` naming each bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid config: {format_validation_error(exc, prefix)}") from exc


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
