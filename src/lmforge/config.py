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
        1000,
        gt=0,
        description="Characters from the start of a document given to the detector; its time grows linearly "
        "with them. On the demo corpus 1000 decides as the whole text does, 500 drops 1 of 769 English "
        "scenes as Latin, 300 drops 3.",
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
    """MinHash LSH near-duplicate removal; one document per cluster (the earliest in the corpus) is kept.

    The default, word 3-grams with 20 bands x 5 rows (a pair with Jaccard 0.6 is a candidate with
    probability 0.8, at 0.7 with 0.98) confirmed at a 0.3 signature agreement, removed every copy with
    1-5 % of words edited and 86 % at 10 % in the planted-copy bench. FineWeb's word 5-grams with 14 x 8
    and no confirmation (``ngram: 5, bands: 14, rows: 8, min_similarity: 0``) needs Jaccard ~0.7 and
    removed about half of the copies at 5 % edits (docs/benchmarks.md has both curves, and datatrove's).
    """

    enabled: bool = Field(True, description="Remove near duplicates.")
    ngram: int = Field(
        3, gt=0, description="Shingle size in words; shorter shingles keep Jaccard high under word edits."
    )
    bands: int = Field(20, gt=0, description="LSH bands; documents sharing any band bucket are candidates.")
    rows: int = Field(5, gt=0, description="MinHash rows per band (bands x rows permutations in all).")
    min_similarity: float = Field(
        0.3,
        ge=0.0,
        le=1.0,
        description="Confirm a candidate pair only when its signature agreement (Jaccard estimate) reaches "
        "this, which drops chance band collisions; 0 accepts every LSH candidate as FineWeb does.",
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
    workers: int = Field(
        0,
        ge=0,
        description="Processes cleaning one shard's documents in parallel; 0 = one per CPU of the pod's limit "
        "(cgroup cpu.max, else the CPU affinity). The output is the same for any number.",
    )
    quarantine_samples: int = Field(100, ge=0, description="Rejected documents kept per rule for review.")
    max_bad_records: int = Field(
        0,
        ge=0,
        description="Malformed records (bad JSON, missing text) tolerated and counted; one more fails the "
        "stage with an error naming file and line.",
    )
    max_record_bytes: int = Field(
        16 * 1024 * 1024,
        ge=1024,
        le=1024 * 1024 * 1024,
        description="Largest JSONL line or .txt document read, in bytes; a larger one is a malformed record "
        "(counted, skipped without being held in memory). Bounds the memory one record can take.",
    )


ChunkLang = Literal["en", "zh", "auto"]
MIN_CHUNK_TOKENS = 8  # enough for any one character, so a chunk never has to split one


class ChunkingConfig(StrictModel):
    """Sentence-aware chunks of the cleaned documents for fine-tuning (``chunks.jsonl`` next to the shards)."""

    enabled: bool = Field(
        True, description="Also write the documents as chunks of whole sentences (spaCy sentencizer) to chunks.jsonl."
    )
    chunk_size: int = Field(
        512,
        ge=MIN_CHUNK_TOKENS,
        description=f"Most tokens per chunk (at least {MIN_CHUNK_TOKENS}); a longer sentence is cut at token "
        "boundaries.",
    )
    lang: ChunkLang = Field(
        "auto",
        description="Sentence rules: en, zh (splits at 。！？ too), or auto = each document's detected language "
        "(zh if mostly Han characters when language ID is off).",
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
    chunking: ChunkingConfig = Field(
        default_factory=ChunkingConfig, description="Sentence-aware chunks for fine-tuning, besides the shards."
    )


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


class CheckpointConfig(StrictModel):
    """Resumable training checkpoints: full state, atomic, to a local path or ``s3://``."""

    dir: str | None = Field(
        None,
        min_length=1,
        description="Where checkpoints go: a local directory or s3://bucket/prefix; null disables checkpoints. "
        "Multi-node runs need s3:// or a shared filesystem.",
    )
    every_steps: int = Field(0, ge=0, description="Write a checkpoint every N optimizer steps (0: by time only).")
    every_minutes: float = Field(
        5.0, ge=0.0, description="Write a checkpoint when this many minutes passed since the last one (0: off)."
    )
    keep_last: int = Field(3, ge=1, description="Complete checkpoints kept; older ones are deleted.")
    resume: Literal["auto", "never"] = Field(
        "auto",
        description="auto: continue from the newest complete checkpoint in dir (start fresh if none); "
        "never: start fresh and refuse a dir that already holds checkpoints.",
    )
    on_sigterm: bool = Field(
        True, description="On SIGTERM (preemption) write a final checkpoint, then stop with TrainingPreempted."
    )

    @model_validator(mode="after")
    def _check_dir(self) -> CheckpointConfig:
        if self.dir is not None and self.dir.startswith("s3://") and not self.dir[len("s3://") :].strip("/"):
            raise ValueError(f"dir: s3 URI {self.dir!r} has no bucket")
        if self.dir is not None and self.every_steps == 0 and self.every_minutes == 0 and not self.on_sigterm:
            raise ValueError("dir is set but every_steps, every_minutes and on_sigterm are all off: nothing is saved")
        return self


class ZeroConfig(StrictModel):
    """DeepSpeed ZeRO settings (the ``zero_optimization`` section of the generated DeepSpeed JSON)."""

    stage: int = Field(2, ge=0, le=3, description="ZeRO stage: 0 off, 1 optimizer, 2 +gradients, 3 +parameters.")
    overlap_comm: bool = Field(True, description="Overlap gradient reduction with the backward pass.")
    contiguous_gradients: bool = Field(True, description="Copy gradients into one buffer as they are produced.")
    reduce_scatter: bool = Field(True, description="Reduce gradients with reduce-scatter instead of all-reduce.")
    reduce_bucket_size: int = Field(
        500_000_000, gt=0, description="Elements reduced at a time (an integer; booleans are rejected)."
    )
    allgather_bucket_size: int = Field(500_000_000, gt=0, description="Elements all-gathered at a time (stage 1/2).")
    stage3_prefetch_bucket_size: int = Field(50_000_000, ge=0, description="Stage 3: elements prefetched ahead.")
    stage3_param_persistence_threshold: int = Field(
        100_000, ge=0, description="Stage 3: parameters smaller than this stay unpartitioned."
    )
    stage3_max_live_parameters: int = Field(
        1_000_000_000, gt=0, description="Stage 3: most parameter elements resident at once on a rank."
    )
    stage3_max_reuse_distance: int = Field(
        1_000_000_000, ge=0, description="Stage 3: keep a parameter gathered if reused within this many elements."
    )
    offload_optimizer: Literal["none", "cpu"] = Field(
        "none", description="ZeRO-Offload: keep optimizer state in CPU memory (stage >= 1)."
    )
    offload_param: Literal["none", "cpu"] = Field(
        "none", description="ZeRO-Infinity: keep parameters in CPU memory (stage 3 only)."
    )

    @model_validator(mode="after")
    def _stage_options(self) -> ZeroConfig:
        if self.offload_param != "none" and self.stage != 3:
            raise ValueError(f"offload_param needs stage 3 (stage is {self.stage})")
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ValueError("offload_optimizer needs stage >= 1 (stage is 0)")
        # Compared with the defaults, not with the keys given, so that a dumped config validates again.
        stage3_only = sorted(
            name
            for name, info in type(self).model_fields.items()
            if name.startswith("stage3_") and getattr(self, name) != info.default
        )
        if stage3_only and self.stage != 3:
            raise ValueError(f"{', '.join(stage3_only)} apply to stage 3 only (stage is {self.stage})")
        return self


class DeepSpeedFp16Config(StrictModel):
    """DeepSpeed dynamic loss scaling; only meaningful with ``precision: fp16``."""

    initial_scale_power: int = Field(16, ge=0, le=32, description="Initial loss scale is 2**this.")
    loss_scale_window: int = Field(1000, gt=0, description="Steps without overflow before the scale grows.")
    hysteresis: int = Field(2, gt=0, description="Overflows tolerated before the scale shrinks.")
    min_loss_scale: float = Field(1.0, gt=0.0, description="Lower bound of the dynamic loss scale.")


class DeepSpeedConfig(StrictModel):
    """DeepSpeed options; the DeepSpeed JSON is generated from these plus the loop settings."""

    zero: ZeroConfig = Field(default_factory=ZeroConfig, description="ZeRO sharding.")
    fp16: DeepSpeedFp16Config | None = Field(
        None, description="Loss-scaling options; allowed only with train.precision fp16 (never with bf16)."
    )
    zero3_init: bool = Field(
        True,
        description="Stage 3: construct the model under zero.Init via HfDeepSpeedConfig, so no rank holds it "
        "whole; the initial weights are the same as without it (Hugging Face initialization, from the seed).",
    )
    communication_data_type: Literal["fp32", "bf16", "fp16"] | None = Field(
        None, description="Dtype of gradient communication; null follows the training precision."
    )


class DistributedConfig(StrictModel):
    """How the loop runs across processes (launched by ``torchrun`` or the Kubeflow Trainer)."""

    backend: Literal["torch", "deepspeed"] = Field(
        "torch",
        description="torch: one process, or DistributedDataParallel when launched with WORLD_SIZE > 1; "
        "deepspeed: DeepSpeed ZeRO (needs the deepspeed extra).",
    )
    process_group: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="Collective backend; auto picks nccl on GPU and gloo on CPU."
    )
    timeout_minutes: float = Field(
        30.0, gt=0.0, description="Collective (NCCL) timeout: a rank stuck this long fails the job."
    )
    find_unused_parameters: bool = Field(False, description="DDP: tolerate parameters that get no gradient.")
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig, description="DeepSpeed options.")

    @model_validator(mode="after")
    def _deepspeed_only_with_backend(self) -> DistributedConfig:
        if self.backend != "deepspeed" and self.deepspeed != DeepSpeedConfig():
            raise ValueError("deepspeed options are set but backend is 'torch'; set backend: deepspeed")
        return self


class TrainConfig(StrictModel):
    """Optimizer, schedule and loop settings shared by pretraining, fine-tuning and distillation."""

    max_steps: int = Field(200, gt=0, description="Optimizer steps.")
    batch_size: int = Field(8, gt=0, description="Sequences per micro-batch on each rank.")
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
    grad_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass (less memory, about 30% more compute)."
    )
    compile: bool = Field(
        False,
        description="torch.compile the model (inductor, on GPU and on CPU with a C++ compiler); the first step "
        "compiles and is left out of tokens/s and MFU.",
    )
    fused_optimizer: bool = Field(
        True,
        description="AdamW's fused kernel where the device has one (CPU, CUDA), which also skips non-finite steps "
        "on the device without a host sync; false uses the foreach kernels. The same update either way.",
    )
    prefetch_batches: int = Field(
        2,
        ge=0,
        description="Micro-batches built ahead in a background thread while the current step computes (0: build "
        "each batch when it is needed).",
    )
    tf32: bool = Field(True, description="Allow TF32 matmuls and convolutions on Ampere+ GPUs (no effect on CPU).")
    deterministic: bool = Field(
        False, description="torch.use_deterministic_algorithms for bitwise-reproducible runs (slower)."
    )
    max_bad_steps: int = Field(
        3,
        gt=0,
        description="Steps with a non-finite loss or gradient norm are skipped and counted; this many in a row "
        "abort the run.",
    )
    peak_flops: float | None = Field(
        None,
        gt=0.0,
        description="Peak FLOP/s of one device for MFU; null looks up known GPUs (bf16 dense) and skips MFU elsewhere.",
    )
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Resumable checkpoints.")
    distributed: DistributedConfig = Field(
        default_factory=DistributedConfig, description="Single process, DDP or DeepSpeed."
    )

    @model_validator(mode="after")
    def _check_schedule(self) -> TrainConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        if self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must not exceed max_steps ({self.max_steps})")
        return self

    @model_validator(mode="after")
    def _check_backend_options(self) -> TrainConfig:
        deepspeed = self.distributed.deepspeed
        if deepspeed.fp16 is not None and self.precision != "fp16":
            raise ValueError(
                f"distributed.deepspeed.fp16: loss scaling is for fp16 only, but precision is {self.precision} "
                "(fp16 and bf16 never together)"
            )
        if self.distributed.backend == "deepspeed" and deepspeed.zero.stage == 3 and self.compile:
            raise ValueError("compile: torch.compile is not supported with ZeRO stage 3 here; set compile: false")
        if self.distributed.backend == "deepspeed" and deepspeed.zero.offload_param != "none" and self.compile:
            raise ValueError("compile: not supported together with distributed.deepspeed.zero.offload_param")
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


# Named LoRA shapes for ``LoraConfig.preset``; fields set explicitly win over them.
LORA_PRESETS: dict[str, dict[str, Any]] = {
    "seeds": {"r": 64, "alpha": 16, "dropout": 0.1},
    "tiny": {"r": 8, "alpha": 16, "dropout": 0.05},
}


class LoraConfig(StrictModel):
    """The ``finetune_lora`` stage (peft LoRA on prompt/response or chat data, answer tokens only in the loss)."""

    preset: Literal["seeds", "tiny"] | None = Field(
        None,
        description="Named LoRA shape filling r/alpha/dropout when they are not set: seeds = r 64, alpha 16, "
        "dropout 0.1 (scaling alpha/r = 0.25); tiny = r 8, alpha 16, dropout 0.05.",
    )
    r: int = Field(8, gt=0, le=4096, description="LoRA rank of the update B·A.")
    alpha: int = Field(16, gt=0, description="LoRA alpha; the update is scaled by alpha/r (alpha/sqrt(r) with rsLoRA).")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the LoRA branch's input.")
    use_rslora: bool = Field(
        False, description="Rank-stabilized LoRA: scale by alpha/sqrt(r) instead of alpha/r (Kalajdzievski 2023)."
    )
    target_modules: list[str] | None = Field(
        None,
        min_length=1,
        description="Module names (last name component) to adapt; null picks the architecture's attention and "
        "MLP projections (gpt2: c_attn, c_proj, c_fc; llama-like: q/k/v/o/gate/up/down_proj).",
    )
    layers_to_transform: list[int] | None = Field(
        None, min_length=1, description="Adapt only these transformer block indices; null adapts every block."
    )
    bias: Literal["none", "all", "lora_only"] = Field(
        "none", description="Biases trained too: none, all biases of the model, or those of adapted modules only."
    )
    modules_to_save: list[str] | None = Field(
        None,
        min_length=1,
        description="Extra modules trained in full and stored in the adapter (e.g. a norm or a new head).",
    )
    chat_template: Literal["auto", "default"] = Field(
        "auto",
        description="How chat `messages` are rendered: auto = the tokenizer's chat template when it has one, "
        "else the default 'User: …/Assistant: …' template; default = always the default template.",
    )
    packing: bool = Field(
        False,
        description="Concatenate training examples into full seq_len rows (no padding; examples may attend to "
        "the previous one). Held-out loss is always computed on unpacked examples.",
    )
    split_long_examples: bool = Field(
        True,
        description="A training example whose answer (a chat's closing assistant message) does not fit seq_len "
        "becomes several, each with the full prompt and a run of whole sentences of the answer, instead of being "
        "truncated. Held-out examples are never split.",
    )
    split_lang: ChunkLang = Field(
        "auto", description="Sentence rules for split_long_examples: en, zh, or auto (zh if mostly Han characters)."
    )
    heldout_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="Fraction of examples held out for eval loss (by hash of the prompt)."
    )
    train: TrainConfig = Field(
        default_factory=lambda: TrainConfig(max_steps=60, lr=2e-3, min_lr=2e-4, warmup_steps=5),
        description="Training loop.",
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") in LORA_PRESETS:
            data = {**LORA_PRESETS[data["preset"]], **data}
        return data

    @model_validator(mode="after")
    def _check_modules(self) -> LoraConfig:
        for name, values in (("target_modules", self.target_modules), ("modules_to_save", self.modules_to_save)):
            if values is not None and len(set(values)) != len(values):
                raise ValueError(f"{name} lists a module twice: {values}")
        both = set(self.target_modules or []) & set(self.modules_to_save or [])
        if both:
            raise ValueError(f"modules {sorted(both)} are both LoRA targets and in modules_to_save; pick one")
        if self.layers_to_transform is not None and min(self.layers_to_transform) < 0:
            raise ValueError(f"layers_to_transform must be block indices >= 0, got {self.layers_to_transform}")
        return self

    @property
    def scaling(self) -> float:
        """The factor applied to B·A: alpha/r, or alpha/sqrt(r) with rsLoRA."""
        return self.alpha / (self.r**0.5 if self.use_rslora else self.r)


class DistillConfig(StrictModel):
    """The ``distill`` stage: student shape and initialization, and the KD loss."""

    student_layer_fraction: float = Field(
        0.5, gt=0.0, le=1.0, description="Student depth as a fraction of the teacher's layers (same width)."
    )
    init: Literal["teacher_layers", "random", "pretrained"] = Field(
        "teacher_layers",
        description="Student initialization: every k-th teacher layer plus embeddings (DistilBERT-style), "
        "random, or the existing model at student_uri.",
    )
    student_uri: str | None = Field(
        None,
        min_length=1,
        description="With init=pretrained: an HF causal LM directory (local or s3://) used as the student; it "
        "must share the teacher's tokenizer.",
    )
    temperature: float = Field(2.0, gt=0.0, description="Softmax temperature T for the KL term.")
    alpha: float = Field(0.5, ge=0.0, le=1.0, description="Weight of the T²·KL term; CE gets 1 − alpha.")
    divergence: Literal["forward", "reverse"] = Field(
        "forward",
        description="forward = KL(teacher‖student) (mean-seeking, Hinton); reverse = KL(student‖teacher) "
        "(mode-seeking, MiniLLM).",
    )
    chunk_tokens: int = Field(
        256,
        gt=0,
        description="Positions per chunk of the KD loss; bounds the fp32 full-vocabulary temporaries to "
        "chunk_tokens × vocab floats.",
    )
    teacher_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="Teacher weights dtype; auto = bf16 on a GPU that supports it, else fp32."
    )
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training loop.")

    @model_validator(mode="after")
    def _student_source(self) -> DistillConfig:
        if (self.init == "pretrained") != (self.student_uri is not None):
            raise ValueError("student_uri is required with init=pretrained and only allowed with it")
        return self


class ExportConfig(StrictModel):
    """The ``export_onnx`` stage."""

    opset: int = Field(18, ge=17, le=23, description="ONNX opset version.")
    parity_tolerance: float = Field(
        1e-3, gt=0.0, description="Maximum |logit| difference allowed between ONNX Runtime and PyTorch."
    )
    with_past: bool = Field(
        True,
        description="Also export decoder_with_past.onnx (KV cache in and out, for generation) next to model.onnx.",
    )


QuantOpType = Literal[
    "all",
    "Add",
    "AveragePool",
    "BatchNormalization",
    "Clip",
    "Conv",
    "ConvTranspose",
    "CumSum",
    "Flatten",
    "Gather",
    "GatherElements",
    "Gemm",
    "InstanceNormalization",
    "LayerNormalization",
    "MatMul",
    "MaxPool",
    "Mul",
    "Pad",
    "Relu",
    "Reshape",
    "Resize",
    "Slice",
    "Split",
    "Squeeze",
    "TopK",
    "Transpose",
    "Unsqueeze",
    "Where",
]
"""Op types with a Q/DQ rule in ONNX Runtime's QDQ registry, plus Add and Mul; ``all`` means every op type
ONNX Runtime can quantize (including those without a rule of their own, such as Softmax)."""


class QuantizeConfig(StrictModel):
    """The ``quantize_int8`` stage: dynamic INT8, calibrated Q/DQ INT8 and the accuracy gate."""

    calibration_sequences: int = Field(128, gt=0, description="Calibration sequences drawn from token shards.")
    calibration_seq_len: int = Field(64, gt=1, description="Tokens per calibration sequence.")
    calibrate_method: Literal["minmax", "entropy", "percentile"] = Field(
        "minmax", description="Static calibration method for the Q/DQ model."
    )
    percentile: float = Field(
        99.999, gt=90.0, le=100.0, description="percentile calibration: the |activation| percentile kept in range."
    )
    histogram_bins: int = Field(
        2048, ge=128, description="entropy/percentile calibration: histogram bins per tensor (entropy uses >= 128)."
    )
    op_types: list[QuantOpType] = Field(
        default_factory=lambda: ["MatMul", "Gemm"],
        min_length=1,
        description="ONNX op types the Q/DQ model quantizes; ['all'] quantizes every op ONNX Runtime can "
        "(costs ~15% perplexity on GPT-2 shapes).",
    )
    per_channel: bool = Field(True, description="Per-channel weight scales in the Q/DQ model.")
    share_tied_embedding: bool = Field(
        True,
        description="Dynamic INT8: a token embedding tied to the LM head looks up rows of the head's int8 table "
        "instead of keeping its own FP32 copy (GPT-2 shapes: about 0.25x the FP32 size instead of 0.55x).",
    )
    exclude_unsafe_nodes: bool = Field(
        True,
        description="Leave unquantized every node touching a tensor whose calibrated range is non-finite or beyond "
        "unsafe_range_limit (e.g. the attention-mask fill value), which would ruin its int8 scale.",
    )
    unsafe_range_limit: float = Field(
        1e6, gt=0.0, description="A calibrated |activation| above this marks the tensor unsafe to quantize."
    )
    max_perplexity_delta: float = Field(
        0.02,
        ge=0.0,
        description="Accuracy gate: an INT8 model whose held-out perplexity exceeds the FP32 model's (same "
        "runtime) by more than this fraction is marked rejected.",
    )
    gate_context: int = Field(128, gt=1, description="Accuracy gate: window length (clamped to the model's positions).")
    gate_eval_tokens: int = Field(
        16_384, gt=1, description="Accuracy gate: held-out (val split) tokens scored per model."
    )


class TensorRTConfig(StrictModel):
    """The ``build_tensorrt`` stage (needs a GPU and the tensorrt package)."""

    precision: Literal["int8", "fp16", "fp32"] = Field("int8", description="Engine precision.")
    graph: Literal["auto", "model", "decoder_with_past"] = Field(
        "auto",
        description="Graph to build: model.onnx (no cache) or decoder_with_past.onnx; auto takes the cache graph "
        "when the directory has one.",
    )
    builder: Literal["python", "trtexec"] = Field(
        "python", description="Build with the TensorRT Python API or by running the trtexec command line tool."
    )
    trtexec: str = Field("trtexec", min_length=1, description="trtexec executable (builder: trtexec).")
    min_batch: int = Field(1, gt=0, description="Optimization profile: minimum batch.")
    opt_batch: int = Field(4, gt=0, description="Optimization profile: optimal batch.")
    max_batch: int = Field(8, gt=0, description="Optimization profile: maximum batch.")
    min_seq: int = Field(1, gt=0, description="Optimization profile: minimum new tokens per call.")
    opt_seq: int = Field(64, gt=0, description="Optimization profile: optimal new tokens per call.")
    max_seq: int = Field(128, gt=0, description="Optimization profile: maximum new tokens per call.")
    min_past: int = Field(0, ge=0, description="Optimization profile (cache graph): minimum cached tokens.")
    opt_past: int = Field(64, ge=0, description="Optimization profile (cache graph): optimal cached tokens.")
    max_past: int = Field(128, ge=0, description="Optimization profile (cache graph): maximum cached tokens.")
    workspace_gib: float = Field(4.0, gt=0.0, description="Builder workspace limit in GiB.")
    timing_cache: str | None = Field(
        None,
        description="Timing-cache file read before and rewritten after each build, so later builds on the same GPU "
        "and TensorRT version reuse kernel timings; null disables it.",
    )

    @model_validator(mode="after")
    def _ordered_profiles(self) -> TensorRTConfig:
        if not self.min_batch <= self.opt_batch <= self.max_batch:
            raise ValueError("profile batch sizes must satisfy min_batch <= opt_batch <= max_batch")
        if not self.min_seq <= self.opt_seq <= self.max_seq:
            raise ValueError("profile sequence lengths must satisfy min_seq <= opt_seq <= max_seq")
        if not self.min_past <= self.opt_past <= self.max_past:
            raise ValueError("profile past lengths must satisfy min_past <= opt_past <= max_past")
        return self


class GateConfig(StrictModel):
    """Thresholds the candidate must meet to be promoted, alone and against the production release."""

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
    min_student_exact_match: float | None = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Fail when the student's exact match on the held-out Q&A set is below this fraction "
        "(null: no check).",
    )
    max_bits_per_byte_regression: float | None = Field(
        0.02,
        ge=0.0,
        description="Fail when the student's bits per byte exceeds the production release's by more than this "
        "fraction (tokenizer-independent; null: no comparison).",
    )
    max_exact_match_regression: float | None = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="Fail when the student's exact match is below the production release's by more than this "
        "(absolute; null: no comparison).",
    )


class GenerationEvalConfig(StrictModel):
    """Greedy generation on the held-out Q&A prompts (EM, F1, BLEU, ROUGE-L)."""

    enabled: bool = Field(True, description="Generate answers to held-out Q&A prompts and score them.")
    models: list[str] = Field(
        default_factory=lambda: ["teacher", "student"],
        description="PyTorch models that generate (by name); ONNX models have no KV-cache decoder to generate with.",
    )
    heldout_fraction: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="Held-out fraction for the prompt-hash split; null takes the one recorded in the LoRA-tuned "
        "teacher's manifest, so the prompts are ones LoRA never trained on.",
    )
    max_prompts: int = Field(
        32, gt=0, description="Held-out prompts scored (all responses of a prompt are references)."
    )
    max_new_tokens: int = Field(24, gt=0, description="Greedy decoding stops at EOS or after this many tokens.")
    batch_size: int = Field(8, gt=0, description="Prompts per generate call (left padded).")
    stop_at_newline: bool = Field(True, description="Cut each answer at its first newline.")
    bleu_tokenize: Literal["13a", "intl", "zh", "char", "none"] = Field(
        "13a", description="sacrebleu tokenizer (13a is sacrebleu's default; zh for Chinese)."
    )
    seed: int = Field(0, ge=0, description="Seed set before generation (greedy decoding is deterministic).")
    samples: int = Field(8, ge=0, description="Prompts with every model's answer shown in the report.")


class EvaluateConfig(StrictModel):
    """The ``evaluate`` stage."""

    context: int = Field(128, gt=1, description="Tokens per forward pass for perplexity (clamped to the models).")
    stride: int | None = Field(
        None,
        gt=0,
        description="New tokens scored per pass after the first; null = context (non-overlapping, lm-eval's "
        "rolling log-likelihood). Smaller gives each token more history at context/stride times the cost.",
    )
    max_eval_tokens: int = Field(20_000, gt=0, description="Held-out tokens scored per model.")
    latency_runs: int = Field(20, gt=0, description="Timed forward passes per model (after warm-up).")
    generation: GenerationEvalConfig = Field(
        default_factory=GenerationEvalConfig, description="Generation metrics on held-out Q&A."
    )
    gate: GateConfig = Field(default_factory=GateConfig, description="Promotion thresholds.")

    @model_validator(mode="after")
    def _stride_within_context(self) -> EvaluateConfig:
        if self.stride is not None and self.stride > self.context:
            raise ValueError(f"stride ({self.stride}) must not exceed context ({self.context})")
        return self


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


# --- lmforge.launch: multi-node training jobs on Kubernetes -------------------------------------------------------

_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
_QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
# An env var whose name says it holds a credential must come from a Secret, never as a literal in a manifest.
_SECRET_LIKE = ("SECRET", "PASSWORD", "TOKEN", "ACCESS_KEY", "PRIVATE_KEY", "CREDENTIAL")


class TolerationConfig(StrictModel):
    """One pod toleration (Kubernetes ``Toleration``) for the training nodes' taints."""

    key: str | None = Field(None, description="Taint key to tolerate; null with operator Exists tolerates all.")
    operator: Literal["Exists", "Equal"] = Field("Exists", description="Exists (any value) or Equal (value).")
    value: str | None = Field(None, description="Taint value (operator Equal only).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        "NoSchedule", description="Taint effect to tolerate; null tolerates every effect."
    )

    @model_validator(mode="after")
    def _value_needs_equal(self) -> TolerationConfig:
        if self.operator == "Exists" and self.value is not None:
            raise ValueError("value must be null when operator is Exists")
        return self


class SecretEnvConfig(StrictModel):
    """Environment variables read from a Kubernetes Secret by reference (the value never enters a manifest)."""

    name: str = Field("lmforge-s3", pattern=_DNS_SUBDOMAIN, description="Secret name in the job's namespace.")
    keys: list[str] = Field(
        default_factory=lambda: ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"],
        min_length=1,
        description="Secret keys; each becomes the env var of the same name (the names boto3 reads).",
    )
    optional: bool = Field(False, description="Start the pods even when the Secret or a key is missing.")

    @model_validator(mode="after")
    def _keys_are_env_names(self) -> SecretEnvConfig:
        import re

        bad = [k for k in self.keys if not re.match(_ENV_NAME, k)]
        if bad:
            raise ValueError(f"keys must be valid env var names, got {bad}")
        return self


def _default_tolerations() -> list[TolerationConfig]:
    return [TolerationConfig(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")]


class LaunchConfig(StrictModel):
    """Multi-node training as a Kubeflow Trainer ``TrainJob`` or a Training Operator ``PyTorchJob``."""

    backend: Literal["trainjob", "pytorchjob"] = Field(
        "trainjob",
        description="trainjob (Kubeflow Trainer v2, trainer.kubeflow.org/v1alpha1) or pytorchjob (Training "
        "Operator v1, kubeflow.org/v1) for older clusters.",
    )
    runtime: Literal["torch-distributed", "deepspeed-distributed"] = Field(
        "torch-distributed",
        description="TrainJob runtime: torch-distributed (torchrun; DeepSpeed runs under it too) or "
        "deepspeed-distributed (MPI launcher). A PyTorchJob always launches with torchrun.",
    )
    runtime_kind: Literal["ClusterTrainingRuntime", "TrainingRuntime"] = Field(
        "ClusterTrainingRuntime", description="Kind of the referenced runtime (TrainingRuntime: namespaced)."
    )
    namespace: str | None = Field(
        None,
        pattern=_DNS_LABEL,
        max_length=63,
        description="Namespace of the job; null: the step's own namespace (its service account's, e.g. the "
        "Kubeflow profile the run belongs to), outside a pod the kubeconfig context's.",
    )
    service_account: str | None = Field(
        "lmforge-worker",
        pattern=_DNS_SUBDOMAIN,
        description="Service account of the training pods (null: the namespace's default). manifests/ creates "
        "lmforge-worker with no API token mounted and no RBAC: the pods only need S3.",
    )
    trainjob_pod_overrides: Literal["auto", "runtimePatches", "podTemplateOverrides"] = Field(
        "auto",
        description="How a TrainJob places its pods (selector, tolerations, service account, /dev/shm): "
        "runtimePatches (Kubeflow Trainer >= v2.2) or podTemplateOverrides (Trainer v2.1, as in Kubeflow 1.11); "
        "auto reads which one the cluster serves from its OpenAPI v3 document for trainer.kubeflow.org/v1alpha1.",
    )
    num_nodes: int = Field(1, ge=1, description="Training nodes (pods); more than 1 launches a job.")
    gpus_per_node: int = Field(1, ge=0, description="nvidia.com/gpu per node; also the processes per node.")
    cpu_per_node: str | None = Field(None, pattern=_QUANTITY, description="CPU request per node, e.g. '32'.")
    memory_per_node: str | None = Field(None, pattern=_QUANTITY, description="Memory request per node, e.g. '200Gi'.")
    shm_size: str | None = Field(
        "16Gi", pattern=_QUANTITY, description="Size of the in-memory /dev/shm (NCCL, data loaders); null: none."
    )
    node_selector: dict[str, str] = Field(
        default_factory=lambda: {"lmforge.io/pool": "gpu"}, description="Node labels the training pods need."
    )
    tolerations: list[TolerationConfig] = Field(
        default_factory=_default_tolerations, description="Taints of the GPU node pool the pods tolerate."
    )
    priority_class: str | None = Field(
        "lmforge-training",
        pattern=_DNS_SUBDOMAIN,
        description="PriorityClass of PyTorchJob pods (a TrainJob takes it from its runtime: its patches "
        "cannot set it).",
    )
    s3_credentials: SecretEnvConfig | None = Field(
        default_factory=SecretEnvConfig, description="S3 credentials as env vars from a Secret (null: none, e.g. IRSA)."
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Plain env vars for the training processes (e.g. AWS_ENDPOINT_URL); never credentials.",
    )
    backoff_limit: int = Field(3, ge=0, description="PyTorchJob pod restarts before the job fails.")
    active_deadline_s: int | None = Field(None, gt=0, description="Server-side limit on the job's run time.")
    wait_timeout_s: int | None = Field(
        None, gt=0, description="Give up waiting (and delete the job) after this many seconds; null: never."
    )
    watch_window_s: int = Field(
        30, gt=0, description="Seconds per watch request; pods and their logs are looked for between them."
    )
    delete_on_success: bool = Field(False, description="Delete the job (and its pods) once it has succeeded.")
    recreate_failed: bool = Field(
        True, description="A retried step finding its job Failed deletes and resubmits it (resume: auto)."
    )
    log_tail_lines: int = Field(50, gt=0, description="Log lines per pod carried in a failure's error message.")

    @model_validator(mode="after")
    def _check(self) -> LaunchConfig:
        if self.backend == "pytorchjob" and self.runtime != "torch-distributed":
            raise ValueError(
                f"runtime {self.runtime!r} is a TrainJob runtime; a PyTorchJob always launches with torchrun "
                "(DeepSpeed runs under it): use runtime 'torch-distributed' or backend 'trainjob'"
            )
        import re

        for name in self.env:
            if not re.match(_ENV_NAME, name):
                raise ValueError(f"env: {name!r} is not a valid env var name")
            secret_keys = self.s3_credentials.keys if self.s3_credentials else []
            if name in secret_keys or any(word in name.upper() for word in _SECRET_LIKE):
                raise ValueError(
                    f"env: {name!r} looks like a credential; pass it by Secret reference (s3_credentials), "
                    "never as a value in the manifest"
                )
        return self
