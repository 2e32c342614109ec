"""The stage registry: every step of the lmforge DAG, declared once.

Each entry names the stage's artifacts and parameters exactly as its KFP component, its entry point and
``lmforge stage NAME --io NAME=...`` name them. Adding a stage is one entry here plus its module (with its
config model), its test and its task in the pipeline; ``lmforge compile`` writes its component
(docs/contributing.md).
"""

from __future__ import annotations

from lmforge.config import (
    CleanConfig,
    DistillConfig,
    EvaluateConfig,
    ExportConfig,
    LoraConfig,
    PretrainConfig,
    QuantizeConfig,
    ServeConfig,
    TensorRTConfig,
    TokenizeConfig,
)
from lmforge.errors import ConfigError, did_you_mean
from lmforge.stages.spec import Port, StageSpec, artifact, param

CORPUS_URI = param("corpus_uri", "str", "Raw corpus: local path, glob, s3:// URI or demo://shakespeare.")


def _fingerprint(
    name: str, of: str, why: str = "so changed data behind an unchanged URI is never served from cache"
) -> Port:
    """A cache key: preflight's output ``name``, the content hash of ``of``."""
    return param(name, "str", f"Content hash of {of} from preflight: part of the cache key, {why}.", default="")


CORPUS_FINGERPRINT = _fingerprint("corpus_fingerprint", "the corpus")
QA_URI = param("qa_uri", "str", "Q&A JSONL (prompt/response or chat messages per line): local, s3:// or demo://.")
RELEASE_ROOT = param("release_root", "str", "Release registry root: a local path or s3://bucket/prefix.")
MODEL_NAME = param("model_name", "str", "Release name: releases live under <release_root>/models/<model_name>/.")
SHARDS = artifact("shards", "Dataset", "Token shards from tokenize (train/val .bin files + index.json).")
DEDUP_SHARDS = artifact("shards", "Dataset", "Cleaned shards from clean_shard (the whole fan-out).", many=True)
BAND_GROUPS = param(
    "band_groups",
    "int",
    "How many groups the LSH bands are split into (at least 1; more than the bands: one band each); each band "
    "task holds only its group's band keys.",
)
EXACT_PARTS = artifact("exact", "Artifact", "Every exact part from dedup_exact_part (the whole fan-out).", many=True)
DEDUP_PARTS = param(
    "parts",
    "int",
    "How many parts the exact digests and each group's band keys are hashed into (at least 1).",
)

BASE_MODEL = param(
    "base_model",
    "str",
    "Base model to start from: a Hugging Face causal-LM directory (local or s3://; config.json, safetensors, "
    "tokenizer files), e.g. from plain save_pretrained; empty: train from scratch with a tokenizer trained here.",
    default="",
)
BASE_MODEL_FINGERPRINT = _fingerprint(
    "base_model_fingerprint", "the base model", "so a changed model behind an unchanged URI is never served from cache"
)
QA_FINGERPRINT = _fingerprint("qa_fingerprint", "the Q&A data")
CLEANED = artifact("cleaned", "Dataset", "Parquet shards (id, text, source, lang), quarantine sample and stats.")
DEDUP_PLAN = artifact("plan", "Artifact", "The corpus keys to remove, with the rule and the kept duplicate.")

_DAG_STAGES: tuple[StageSpec, ...] = (
    StageSpec(
        name="plan_shards",
        summary="List the shard indices 0 .. shard_count-1 for the cleaning fan-out (dsl.ParallelFor).",
        entry="lmforge.data.plan_shards:run",
        config=None,
        inputs=(param("shard_count", "int", "How many shards to split the corpus into (at least 1)."),),
        returns=(param("shard_indices", "list[int]", "The shard indices."),),
        headline=("shards",),
    ),
    StageSpec(
        name="clean_shard",
        summary="Apply the cleaning rules and PII redaction to one shard of the corpus and MinHash-sign its documents.",
        entry="lmforge.data.clean_shard:run",
        config=CleanConfig,
        section="clean",
        inputs=(
            CORPUS_URI,
            param("shard_index", "int", "Which shard this task cleans (0-based)."),
            param("shard_count", "int", "How many shards the corpus is split into."),
        ),
        outputs=(
            artifact(
                "shard",
                "Dataset",
                "Surviving documents with their corpus keys, dedup signatures, quarantine sample and counters.",
            ),
        ),
        cache_keys=(CORPUS_FINGERPRINT,),
        headline=("docs_in", "docs_out"),
    ),
    StageSpec(
        name="dedup_shards",
        summary="Cluster exact and near duplicates across all shards; keep one document per cluster, "
        "deterministically.",
        entry="lmforge.data.dedup_shards:run",
        config=CleanConfig,
        section="clean",
        inputs=(DEDUP_SHARDS,),
        outputs=(DEDUP_PLAN,),
        headline=("removed_exact_dedup", "removed_near_dedup"),
    ),
    StageSpec(
        name="plan_dedup",
        summary="List the task indices of the partitioned dedup's two fan-outs: exact parts and band tasks "
        "(band group × part).",
        entry="lmforge.data.plan_dedup:run",
        config=CleanConfig,
        section="clean",
        inputs=(BAND_GROUPS, DEDUP_PARTS),
        returns=(
            param("exact_parts", "list[int]", "Exact part indices 0 .. parts-1."),
            param(
                "band_tasks",
                "list[int]",
                "Band task indices 0 .. G·parts-1; task t is band group t // parts and part t % parts (G: "
                "band_groups, at most one group per LSH band).",
            ),
        ),
        headline=("exact_parts", "band_tasks"),
    ),
    StageSpec(
        name="dedup_exact_part",
        summary="Find the exact duplicates among the documents whose digest falls in one part (the smallest key of "
        "each text is kept).",
        entry="lmforge.data.dedup_exact_part:run",
        config=CleanConfig,
        section="clean",
        inputs=(
            DEDUP_SHARDS,
            param("part", "int", "Which part of the digests this task owns (0-based)."),
            DEDUP_PARTS,
        ),
        outputs=(artifact("exact", "Artifact", "Exact duplicates of this part: (key, duplicate_of) pairs."),),
        headline=("pairs",),
    ),
    StageSpec(
        name="dedup_band_part",
        summary="Emit the confirmed near-duplicate candidate pairs of one LSH band group and one part of its bucket "
        "keys, exact duplicates left out.",
        entry="lmforge.data.dedup_band_part:run",
        config=CleanConfig,
        section="clean",
        inputs=(
            DEDUP_SHARDS,
            EXACT_PARTS,
            param("band_task", "int", "Which band task this is (0-based): band group t // parts, part t % parts."),
            BAND_GROUPS,
            DEDUP_PARTS,
        ),
        outputs=(artifact("pairs", "Artifact", "Candidate pairs (key, duplicate_of) of this band group and part."),),
        headline=("pairs",),
    ),
    StageSpec(
        name="dedup_union",
        summary="Union-find over the exact and band pairs only: the same removal plan as dedup_shards, keeping the "
        "earliest document of every cluster.",
        entry="lmforge.data.dedup_union:run",
        config=CleanConfig,
        section="clean",
        inputs=(
            DEDUP_SHARDS,
            EXACT_PARTS,
            artifact("pairs", "Artifact", "Every band task's pairs from dedup_band_part (whole fan-out).", many=True),
        ),
        outputs=(DEDUP_PLAN,),
        headline=("removed_exact_dedup", "removed_near_dedup"),
    ),
    StageSpec(
        name="merge_shards",
        summary="Merge the shards in corpus order without the documents the dedup plan removes: the cleaned corpus.",
        entry="lmforge.data.merge_shards:run",
        config=CleanConfig,
        section="clean",
        inputs=(
            param("corpus_uri", "str", "The raw corpus URI (recorded in the manifest)."),
            DEDUP_SHARDS,
            artifact("plan", "Artifact", "Removal plan from dedup_union (or dedup_shards)."),
        ),
        outputs=(CLEANED,),
        html="report",
        headline=("docs_in", "docs_out"),
    ),
    StageSpec(
        name="clean",
        summary="Normalize, filter, redact and deduplicate a raw corpus into Parquet shards in one step "
        "(clean_shard, dedup_shards and merge_shards with one shard).",
        entry="lmforge.data.clean:run",
        config=CleanConfig,
        inputs=(CORPUS_URI,),
        outputs=(CLEANED,),
        cache_keys=(CORPUS_FINGERPRINT,),
        html="report",
        headline=("docs_in", "docs_out"),
    ),
    StageSpec(
        name="tokenize",
        summary="Train a byte-level BPE tokenizer on the cleaned corpus and pack train/val token shards.",
        entry="lmforge.data.tokenize:run",
        config=TokenizeConfig,
        inputs=(artifact("cleaned", "Dataset", "Cleaned corpus from clean or merge_shards."), BASE_MODEL),
        outputs=(
            artifact("tokenizer", "Artifact", "Hugging Face fast tokenizer directory."),
            artifact("shards", "Dataset", "train-NNNNN.bin / val-NNNNN.bin token shards with index.json."),
        ),
        cache_keys=(BASE_MODEL_FINGERPRINT,),
        headline=("train_tokens", "vocab_size"),
    ),
    StageSpec(
        name="pretrain",
        summary="Pretrain a causal LM (AdamW, warmup + cosine, clipping, autocast) on the token shards.",
        entry="lmforge.train.pretrain:run",
        config=PretrainConfig,
        inputs=(
            SHARDS,
            artifact("tokenizer", "Artifact", "Tokenizer from tokenize (its hash must match the shards')."),
            BASE_MODEL,
        ),
        outputs=(
            artifact("model", "Model", "Hugging Face model directory (safetensors, tokenizer, training history)."),
        ),
        cache_keys=(BASE_MODEL_FINGERPRINT,),
        html="curves",
        runtime="train",
        distributed=True,
        headline=("val_loss", "tokens_per_sec"),
    ),
    StageSpec(
        name="finetune_lora",
        summary="Fine-tune the base model with LoRA on Q&A pairs (prompt tokens masked from the loss); emit the "
        "adapter and the merged model.",
        entry="lmforge.train.finetune_lora:run",
        config=LoraConfig,
        inputs=(artifact("base_model", "Model", "Hugging Face causal LM directory (e.g. from pretrain)."), QA_URI),
        outputs=(
            artifact("adapter", "Model", "PEFT adapter directory."),
            artifact("merged_model", "Model", "Standalone model with the adapter merged in (the teacher)."),
        ),
        cache_keys=(QA_FINGERPRINT,),
        html="curves",
        runtime="train",
        distributed=True,
        headline=("tuned_heldout_loss", "heldout_loss_reduction"),
    ),
    StageSpec(
        name="distill",
        summary="Train a shallower student on alpha·T²·KL(teacher‖student) + (1−alpha)·CE over the token shards.",
        entry="lmforge.train.distill:run",
        config=DistillConfig,
        inputs=(
            artifact("teacher", "Model", "Teacher causal LM (the merged LoRA model), on the shards' tokenizer."),
            SHARDS,
            param(
                "qa_uri",
                "str",
                "Q&A JSONL mixed into the batches (its train split, the one LoRA made); empty: the one recorded in "
                "the teacher's manifest.",
                default="",
            ),
            param(
                "student_base",
                "str",
                "A smaller pretrained student (Hugging Face directory, local or s3://) sharing the teacher's "
                "tokenizer; empty: the student is built from the teacher's layers.",
                default="",
            ),
        ),
        outputs=(artifact("student", "Model", "Student Hugging Face model directory."),),
        cache_keys=(
            QA_FINGERPRINT,
            param(
                "student_base_fingerprint",
                "str",
                "Content hash of the student base from preflight: part of the cache key.",
                default="",
            ),
        ),
        html="curves",
        runtime="train",
        distributed=True,
        headline=("student_val_loss", "teacher_val_loss"),
    ),
    StageSpec(
        name="export_onnx",
        summary="Export a causal LM to ONNX (with and without KV cache) and check logits parity against PyTorch.",
        entry="lmforge.export.export_onnx:run",
        config=ExportConfig,
        inputs=(artifact("model", "Model", "Hugging Face causal LM directory."),),
        outputs=(artifact("onnx_model", "Model", "model.onnx (KV cache), decoder_model.onnx, tokenizer, config."),),
        headline=("parity_max_abs_diff",),
    ),
    StageSpec(
        name="quantize_int8",
        summary="Quantize an FP32 ONNX model to INT8: dynamic (ONNX Runtime on CPU) and static Q/DQ calibrated on "
        "the shards, each behind an accuracy gate.",
        entry="lmforge.export.quantize_int8:run",
        config=QuantizeConfig,
        inputs=(
            artifact("onnx_model", "Model", "FP32 ONNX model directory from export_onnx."),
            artifact("shards", "Dataset", "Token shards the calibration batches are drawn from (same tokenizer)."),
        ),
        outputs=(
            artifact("int8_dynamic", "Model", "Dynamically quantized ONNX model directory."),
            artifact("int8_qdq", "Model", "Statically calibrated Q/DQ ONNX model directory (TensorRT input)."),
        ),
        html="report",
        headline=("fp32_size_mb", "dynamic_size_mb"),
    ),
    StageSpec(
        name="build_tensorrt",
        summary="Build a strongly typed TensorRT engine; without TensorRT or a GPU, record an explicit skipped status.",
        entry="lmforge.export.build_tensorrt:run",
        config=TensorRTConfig,
        inputs=(artifact("int8_qdq", "Model", "Q/DQ ONNX model directory from quantize_int8."),),
        outputs=(
            artifact("engine", "Artifact", "engine.plan + build_record.json, or status.json saying skipped and why."),
        ),
        runtime="tensorrt",
        headline=("built",),
    ),
    StageSpec(
        name="evaluate",
        summary="Held-out perplexity, generation quality, size and latency of every model; the report and the "
        "promotion gate's decision.",
        entry="lmforge.evaluate.evaluate:run",
        config=EvaluateConfig,
        inputs=(
            SHARDS,
            artifact("teacher", "Model", "Merged LoRA model (the teacher).", required=False),
            artifact("student", "Model", "Distilled student.", required=False),
            artifact("onnx_fp32", "Model", "FP32 ONNX export of the student.", required=False),
            artifact("int8_dynamic", "Model", "Dynamic INT8 ONNX model.", required=False),
            artifact("int8_qdq", "Model", "Calibrated Q/DQ INT8 ONNX model.", required=False),
            artifact("engine", "Artifact", "TensorRT engine directory (or its skipped status).", required=False),
            artifact("cleaned", "Dataset", "Cleaned corpus; its stats feed the report's data summary.", required=False),
            artifact(
                "base",
                "Model",
                "The pretrained model the teacher was tuned from (pretrain's output): evaluated beside teacher and "
                "student, the gate's reference for forgetting.",
                required=False,
            ),
            param(
                "qa_uri",
                "str",
                "Q&A data: its held-out pairs (never trained on) score EM/F1/BLEU/ROUGE-L; empty: the one recorded "
                "in the teacher's manifest.",
                default="",
            ),
            param(
                "release_root",
                "str",
                "Release registry root: the candidate is compared with the production release of model_name "
                "(latest.json); empty: no comparison.",
                default="",
            ),
            param("model_name", "str", "Release name whose production release is the gate's baseline.", default=""),
            param(
                "plan",
                "str",
                "The training plan from preflight (JSON; empty: none): the report sets it against what each training "
                "stage measured.",
                default="",
            ),
        ),
        outputs=(artifact("evaluation", "Artifact", "results.json, report.html, report.md and manifest."),),
        returns=(param("passed", "bool", "Whether every gate check passed (promote runs only then)."),),
        cache_keys=(
            param(
                "production_fingerprint",
                "str",
                "Fingerprint of the production release from preflight: part of the cache key, so a run after a new "
                "release re-evaluates instead of reusing a gate decided against the old one.",
                default="",
            ),
        ),
        html="report",
        markdown="summary",
        context=("preset", "run_id"),
        headline=("passed",),
    ),
    StageSpec(
        name="promote",
        summary="Publish the release to <release_root>/models/<model_name>/<version>/ with a lineage manifest; "
        "never overwrites.",
        entry="lmforge.release.promote:run",
        config=None,
        inputs=(
            artifact("student", "Model", "Distilled student model."),
            artifact("onnx_fp32", "Model", "FP32 ONNX model."),
            artifact("int8_dynamic", "Model", "Dynamic INT8 ONNX model."),
            artifact("int8_qdq", "Model", "Q/DQ INT8 ONNX model."),
            artifact("engine", "Artifact", "TensorRT engine directory or its skipped status."),
            artifact("evaluation", "Artifact", "Evaluation results and report (the gate must have passed)."),
            RELEASE_ROOT,
            MODEL_NAME,
            param("version", "str", "Release version; empty picks a UTC timestamp vYYYYMMDD-HHMMSS.", default=""),
        ),
        returns=(param("release_uri", "str", "The release URI."),),
        context=("run_id",),
        headline=("version", "status"),
    ),
    StageSpec(
        name="serve",
        summary="Write the KServe InferenceService for the release (lmforge predictor, Triton on a GPU, or KServe's "
        "Hugging Face runtime) and, with serve.apply in a cluster, create or update it and wait for Ready; otherwise "
        "record why it was skipped.",
        entry="lmforge.serve.serve:run",
        config=ServeConfig,
        inputs=(
            param("release", "str", "The release URI <release_root>/models/<name>/<version> (promote's release_uri)."),
            param(
                "predictor_image",
                "str",
                "Image of the lmforge predictor (images/serve) when serve.image is null; the pipeline passes the one "
                "it was compiled with.",
                default="",
            ),
            param(
                "gpu_node_selector",
                "dict",
                "Node selector of a GPU predictor when serve.node_selector is null (the pipeline's, as for its GPU "
                "steps).",
                default={},
            ),
            param(
                "gpu_tolerations",
                "list",
                "Tolerations of a GPU predictor when serve.tolerations is null (the pipeline's, as for its GPU steps).",
                default=[],
            ),
        ),
        outputs=(
            artifact(
                "serving",
                "Artifact",
                "inferenceservice.yaml, servingruntime.yaml (lmforge runtime) or the Triton repository, and "
                "status.json: applied, or skipped and why, with the local `lmforge serve` command.",
            ),
        ),
    ),
)


_PREFLIGHT_INPUTS = (
    CORPUS_URI,
    QA_URI,
    RELEASE_ROOT,
    param(
        "s3_secret_name",
        "str",
        "Secret holding the S3 credentials (checked only inside a cluster; skipped with IRSA).",
        default="lmforge-s3",
    ),
    param(
        "launch",
        "str",
        "The training steps' LaunchConfig JSON: validated here, and with num_nodes > 1 the cluster must "
        "serve its job kind (TrainJob or PyTorchJob).",
        default="{}",
    ),
    param("gpu_count", "int", "GPUs per GPU-stage pod (at least 0).", default=1),
    param(
        "model_name",
        "str",
        "Release name; empty: derived from the corpus (lmforge-demo for the demo corpus).",
        default="",
    ),
    param(
        "preset",
        "str",
        "Preset every stage's config starts from; each section is validated here.",
        default="tiny-cpu",
    ),
    param(
        "base_model_uri",
        "str",
        "Base model tokenize and pretrain start from (the pipeline's base_model_uri): its architecture and "
        "tokenizer are checked and its files fingerprinted here; empty: none.",
        default="",
    ),
    param(
        "student_base_uri",
        "str",
        "Pretrained student distill starts from (the pipeline's student_base_uri): checked like the base "
        "model, and its tokenizer against the base model's when both are given; empty: none.",
        default="",
    ),
    param(
        "staging_uri",
        "str",
        "The pipeline's staging_uri: with it the run's root (run_root) is there, else the release root.",
        default="",
    ),
)
"""The ``preflight`` stage's parameters but the config sections' overrides (:func:`_overrides`)."""

_PREFLIGHT_RETURNS = (
    param("corpus_fingerprint", "str", "sha256 of the corpus content (downstream cache keys)."),
    param("qa_fingerprint", "str", "sha256 of the Q&A data (downstream cache keys)."),
    param("production_fingerprint", "str", "Fingerprint of the production release the gate compares with."),
    param(
        "gpu_limit",
        "str",
        "gpu_count as a string: the KFP backend's driver reads an accelerator limit only from a string "
        "parameter (an integer one is dropped), so the GPU steps take their limit from here.",
    ),
    param("model_name", "str", "The release name every later step uses."),
    param("base_model_fingerprint", "str", "Fingerprint of the base model's files; empty without one."),
    param("student_base_fingerprint", "str", "Fingerprint of the student base's files; empty without one."),
    param(
        "run_root",
        "str",
        "The run's root ({run_root} of a templated checkpoint.dir, $LMFORGE_RUN_ROOT of the training steps): "
        "staging_uri when given, else release_root.",
    ),
    param(
        "plan",
        "str",
        "The training plan on launch.accelerator as JSON: each training stage's parameters, tokens, FLOPs, memory "
        "per GPU, hours, GPU-hours and the MFU behind them (measured in an earlier run, or assumed).",
    ),
)


def _overrides(sections: tuple[str, ...]) -> tuple[Port, ...]:
    """One ``<section>_overrides`` parameter of ``preflight`` per config section."""
    return tuple(
        param(
            f"{section}_overrides",
            "str",
            f"The {section} stage's overrides (the pipeline's {section}_overrides): validated here, before "
            "any stage starts.",
            default="{}",
        )
        for section in sections
    )


def _preflight(sections: tuple[str, ...]) -> StageSpec:
    """``preflight``: it validates every config section, so its ports follow the other stages' sections."""
    return StageSpec(
        name="preflight",
        summary="Check that inputs are readable, the registry writable and the S3 Secret present; fingerprint the "
        "data and the production release; plan every training stage on the accelerator.",
        entry="lmforge.preflight.preflight:run",
        config=None,
        inputs=(*_PREFLIGHT_INPUTS, *_overrides(sections)),
        returns=_PREFLIGHT_RETURNS,
        headline=("checks_passed", "predicted_retention", "retention_warning"),
    )


_SECTIONS = tuple(dict.fromkeys(spec.section for spec in _DAG_STAGES if spec.section))
_STAGES: tuple[StageSpec, ...] = (_preflight(_SECTIONS), *_DAG_STAGES)

STAGES: dict[str, StageSpec] = {spec.name: spec for spec in _STAGES}


def get_stage(name: str) -> StageSpec:
    """The registered stage ``name``.

    Raises:
        ConfigError: no such stage; the message lists them and names the nearest one.
    """
    if name in STAGES:
        return STAGES[name]
    raise ConfigError(f"unknown stage {name!r}{did_you_mean(name, STAGES)}; stages: {', '.join(STAGES)}")


def register(spec: StageSpec) -> StageSpec:
    """Add a stage (a plugin's, or a test's throwaway one); a name already registered is refused."""
    if spec.name in STAGES:
        raise ConfigError(f"stage {spec.name!r} is already registered")
    STAGES[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a stage added with :func:`register`; the built-in stages stay."""
    if name in {spec.name for spec in _STAGES}:
        raise ConfigError(f"stage {name!r} is built in and cannot be removed")
    STAGES.pop(name, None)
