"""Configs of ``evaluate`` (held-out metrics, the gate) and ``promote`` (the release)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from lmforge.config.base import StrictModel
from lmforge.errors import did_you_mean

GATE_CHECKS = (
    "student_perplexity",
    "int8_perplexity_delta",
    "served_p99_latency_ms",
    "student_exact_match",
    "answer_loss_vs_teacher",
    "f1_vs_teacher",
    "served_empty_answers",
    "teacher_forgetting",
    "student_forgetting",
    "data_retention",
    "bits_per_byte_vs_production",
    "exact_match_vs_production",
)
"""The gate's checks by name, in report order (:mod:`lmforge.evaluate.gate` runs them)."""


class HarnessCheck(StrictModel):
    """Gate checks on one harness metric (``harness.<task>.<metric>``), in the gate's forms: a floor, a drop
    against the teacher (a fraction of the teacher's value) and a drop against production (absolute)."""

    model: str = Field("student", description="Whose metric is checked.")
    min: float | None = Field(None, description="Fail when the metric is below this (null: no floor).")
    max_drop_vs_teacher: float | None = Field(
        None,
        ge=0.0,
        description="Fail when the metric is below the teacher's by more than this fraction of the teacher's "
        "(null: no comparison; for a lower-is-better metric such as perplexity, the rise).",
    )
    max_drop_vs_production: float | None = Field(
        None,
        ge=0.0,
        description="Fail when the metric is below the production release's by more than this (absolute; null: "
        "no comparison; for a lower-is-better metric, the rise).",
    )


class GateConfig(StrictModel):
    """Thresholds the candidate must meet to be promoted: alone, against the teacher and the base model it came
    from, and against the production release. The defaults fail a model that answers nothing."""

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
    max_answer_loss_increase: float | None = Field(
        0.25,
        ge=0.0,
        description="Fail when the served model's held-out answer loss (mean cross-entropy over the reference "
        "answers, prompt masked) exceeds the teacher's by more than this fraction (null: no check).",
    )
    max_f1_drop: float | None = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Fail when the student's held-out F1 is below the teacher's by more than this fraction of the "
        "teacher's F1 (null: no check).",
    )
    max_empty_answers: float | None = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Fail when more than this fraction of the served model's answers to the held-out prompts are "
        "empty (its student's where the served model cannot generate here, e.g. a TensorRT engine; null: no check).",
    )
    max_teacher_forgetting: float | None = Field(
        0.25,
        ge=0.0,
        description="Fail when the teacher's bits per byte on held-out corpus text exceeds the base (pretrained) "
        "model's by more than this fraction: how much fine-tuning may forget (null: no check).",
    )
    max_student_forgetting: float | None = Field(
        0.25,
        ge=0.0,
        description="Fail when the student's bits per byte on held-out corpus text exceeds the base model's by more "
        "than this fraction (null: no check).",
    )
    retention_warning: float | None = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Warn (gate record, report summary, the run's last lines) when cleaning kept less than this "
        "fraction of the corpus's documents or bytes (null: no warning).",
    )
    min_retention: float | None = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="Fail when cleaning kept less than this fraction of the corpus's documents or bytes (null: the "
        "check is n/a and only retention_warning warns). A corpus the web rules do not fit usually keeps more under "
        "another clean.profile (docs, code, chat).",
    )
    harness: dict[str, HarnessCheck] = Field(
        default_factory=dict,
        description="Checks on lm-evaluation-harness metrics by name harness.<task>.<metric> "
        "(e.g. harness.lmforge_qa_mc.acc: {min: 0.3, max_drop_vs_teacher: 0.1}).",
    )

    required: list[str] = Field(
        default_factory=list,
        description="Checks that must PASS for a promotion: an n/a (nothing to compare with, a threshold no value "
        "can miss, a zero baseline, too few held-out tokens or prompts) or off check among them stops it. Every "
        "other check stops a promotion only when it fails. Names: " + ", ".join(GATE_CHECKS) + ".",
    )

    @field_validator("required")
    @classmethod
    def _known_checks(cls, names: list[str]) -> list[str]:
        for name in names:
            if name not in GATE_CHECKS:
                raise ValueError(f"unknown gate check {name!r}{did_you_mean(name, GATE_CHECKS)}")
        return names

    @model_validator(mode="after")
    def _harness_names(self) -> GateConfig:
        for name in self.harness:
            if name.count(".") < 2 or not name.startswith("harness."):
                raise ValueError(f"gate.harness key {name!r} must be harness.<task>.<metric>")
        return self


class GenerationEvalConfig(StrictModel):
    """Greedy generation on the held-out Q&A prompts (EM, F1, BLEU, ROUGE-L)."""

    enabled: bool = Field(True, description="Generate answers to held-out Q&A prompts and score them.")
    models: list[str] = Field(
        default_factory=lambda: ["base", "teacher", "student"],
        description="PyTorch models that generate (by name); the served model generates too (see served).",
    )
    served: bool = Field(
        True,
        description="Also generate with the served model (the KV-cache decoder of the ONNX model promote serves, "
        "decoded as lmforge serve decodes), so the gate's empty-answer check sees what users get.",
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
    min_prompts: int = Field(
        20,
        ge=0,
        description="Q&A metrics (EM, F1, BLEU, ROUGE-L, empty answers, answer loss) from fewer held-out prompts are "
        "marked 'low confidence' in the report, the console and the gate, where a check on them is n/a "
        "instead of PASS.",
    )
    max_new_tokens: int = Field(24, gt=0, description="Greedy decoding stops at EOS or after this many tokens.")
    batch_size: int = Field(8, gt=0, description="Prompts per generate call (left padded).")
    stop_at_newline: bool = Field(True, description="Cut each answer at its first newline.")
    bleu_tokenize: Literal["13a", "intl", "zh", "char", "none"] = Field(
        "13a", description="sacrebleu tokenizer (13a is sacrebleu's default; zh for Chinese)."
    )
    seed: int = Field(0, ge=0, description="Seed set before generation (greedy decoding is deterministic).")
    samples: int = Field(8, ge=0, description="Prompts with every model's answer shown in the report.")


class HarnessConfig(StrictModel):
    """Standard evaluations with lm-evaluation-harness (the ``harness`` extra) on the PyTorch models."""

    enabled: bool = Field(True, description="Run the harness tasks (skipped with a log line without lm-eval).")
    tasks: list[str] = Field(
        default_factory=lambda: ["lmforge_qa_mc", "lmforge_cloze"],
        description="Task names (lmforge's packaged lmforge_qa_mc and lmforge_cloze, or any lm-evaluation-harness "
        "task, e.g. hellaswag, arc_easy, mmlu, for clusters that reach the Hugging Face hub) and/or task YAML files "
        "(local or s3://) whose dataset_kwargs.data_files are local paths (relative to the YAML) or s3:// URIs, "
        "fetched first.",
    )
    models: list[str] = Field(
        default_factory=lambda: ["base", "teacher", "student"],
        description="PyTorch models the tasks run on (by name).",
    )
    limit: int | None = Field(None, gt=0, description="Documents per task (null: all).")
    num_fewshot: int | None = Field(None, ge=0, description="Few-shot examples per prompt (null: each task's own).")
    batch_size: int = Field(16, gt=0, description="Requests per forward pass.")
    bootstrap_iters: int = Field(
        1000,
        ge=0,
        description="Resamples for the bootstrap standard errors (perplexity); lm-eval's own default, 100000, "
        "costs seconds per task and model (0: no bootstrap standard errors).",
    )


class ModelCardConfig(StrictModel):
    """What the release's model card (README.md, Hugging Face card metadata) says beyond the run's numbers."""

    license: str = Field(
        "other", description="License identifier of the released weights (Hugging Face card 'license', e.g. mit)."
    )
    language: list[str] = Field(default_factory=lambda: ["en"], description="Languages of the training text.")
    base_model: str | None = Field(
        None, description="Hub id (org/name) of the model the run started from (card 'base_model'); null: from scratch."
    )
    tags: list[str] = Field(default_factory=lambda: ["lmforge"], description="Extra card tags.")


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
    harness: HarnessConfig = Field(
        default_factory=HarnessConfig, description="lm-evaluation-harness tasks (report, metrics, gate checks)."
    )
    gate: GateConfig = Field(default_factory=GateConfig, description="Promotion thresholds.")
    card: ModelCardConfig = Field(
        default_factory=ModelCardConfig, description="Model card metadata (promote writes the card into the release)."
    )
    production_source: Literal["registry", "mlflow"] = Field(
        "registry",
        description="Where the gate's production baseline comes from: registry = the release root's latest.json; "
        "mlflow = the model version the MLflow Model Registry alias names (registered model = the release name, "
        "alias 'production'; needs MLflow tracking on), so promoting and rolling back can be done in MLflow.",
    )

    @model_validator(mode="after")
    def _stride_within_context(self) -> EvaluateConfig:
        if self.stride is not None and self.stride > self.context:
            raise ValueError(f"stride ({self.stride}) must not exceed context ({self.context})")
        return self
