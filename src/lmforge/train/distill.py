"""The ``distill`` stage: a smaller student trained on the teacher's soft targets, on corpus windows and on the
fine-tuning examples the teacher was tuned on (:mod:`lmforge.train.mixture`), so the served student keeps the task.

The student is the teacher with fewer blocks (initialized from teacher layers, or randomly), or a smaller
pretrained model given as ``student_base`` that shares the teacher's tokenizer (vocabulary and special tokens).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, PreTrainedModel

from lmforge import storage
from lmforge.artifacts import input_record, write_manifest
from lmforge.config import DistillConfig
from lmforge.data.qa import qa_lineage
from lmforge.errors import ConfigError, InputDataError
from lmforge.model.base import (
    align_special_tokens,
    base_tokenizer,
    localize_base,
    localize_model,
    model_record,
    tokenizer_mismatch,
)
from lmforge.model.build import count_parameters, load_causal_lm, save_model_dir
from lmforge.model.student import student_layers
from lmforge.report_html import page, table
from lmforge.results import StageResult
from lmforge.train.batches import IGNORE_INDEX, open_matching_shards
from lmforge.train.distributed import (
    DistContext,
    describe_backend,
    distributed_context,
    main_rank_outputs,
    refuse_occupied,
)
from lmforge.train.frozen_shard import local_weight_bytes, shard_frozen
from lmforge.train.loop import (
    LossFn,
    curves_section,
    evaluate,
    quarantine_facts,
    scale_metrics,
    tokens_per_sec,
    train,
    whole_model,
)
from lmforge.train.losses import ChunkedKDLoss, KDTerms, causal_lm_loss, masked_ce
from lmforge.train.mfu import distillation_model_flops_per_token
from lmforge.train.mixture import (
    Mixture,
    QARows,
    heldout_batches,
    load_qa_rows,
    mixture_batches,
    plan_mixture,
    trained_on,
)

logger = logging.getLogger("lmforge.distill")

# Where each architecture keeps its list of transformer blocks in the state dict.
BLOCK_PREFIXES = {"gpt2": "transformer.h.", "llama": "model.layers."}


def make_student(teacher: PreTrainedModel, fraction: float, init: str, *, seed: int) -> PreTrainedModel:
    """A student with the teacher's config but fewer blocks.

    ``init="teacher_layers"`` copies embeddings, final norm, LM head and the blocks named by
    :func:`student_layers` (DistilBERT-style); ``"random"`` keeps the fresh initialization.
    """
    arch = teacher.config.model_type
    if arch not in BLOCK_PREFIXES:
        raise ConfigError(f"distill: architecture {arch!r} not supported; expected one of {list(BLOCK_PREFIXES)}")
    layers = student_layers(teacher.config.num_hidden_layers, fraction)
    config = copy.deepcopy(teacher.config)
    config.num_hidden_layers = len(layers)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[j] for j in layers]
    torch.manual_seed(seed)
    student = AutoModelForCausalLM.from_config(config)
    if init == "teacher_layers":
        prefix = re.escape(BLOCK_PREFIXES[arch])
        block_key = re.compile(rf"^{prefix}(\d+)\.")
        teacher_state = teacher.state_dict()
        state = {
            key: teacher_state[block_key.sub(lambda m: f"{BLOCK_PREFIXES[arch]}{layers[int(m[1])]}.", key)]
            for key in student.state_dict()
        }
        student.load_state_dict(state, strict=True)
    return student.to(torch.float32)  # master weights stay fp32 whatever the teacher runs in


def teacher_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The dtype the frozen teacher runs in: bf16 when asked, or with ``auto`` on a GPU that supports it."""
    if setting == "bf16":
        return torch.bfloat16
    if setting == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def _load_student_base(uri: str | Path, workdir: Path, teacher_dir: Path, teacher_uri: str | Path) -> Path:
    """Localize a pretrained student and check it can learn from the teacher: same vocabulary and special tokens."""
    local = localize_base(uri, workdir, what="distill: student_base")
    if mismatch := tokenizer_mismatch(base_tokenizer(teacher_dir), base_tokenizer(local)):
        raise InputDataError(
            f"distill: student_base {uri} does not share the teacher {teacher_uri}'s tokenizer ({mismatch}); "
            "teacher and student must have the same vocabulary and special tokens"
        )
    return local


def run(
    cfg: DistillConfig,
    *,
    teacher: str | Path,
    shards: str | Path,
    student: str | Path,
    qa_uri: str | None = None,
    student_base: str | Path | None = None,
) -> StageResult:
    """Distill the teacher into a student on a mixture of corpus windows and fine-tuning examples.

    The student has ``student_layer_fraction`` of the teacher's blocks, or is the pretrained ``student_base``.
    The teacher, the student base and the shards may be local directories or ``s3://`` prefixes. The teacher
    is frozen (eval mode, no grad, bf16 where supported); the student is trained on
    ``alpha·T²·KL + (1 − alpha)·CE`` (:class:`~lmforge.train.losses.ChunkedKDLoss`) over corpus windows and
    over the responses of the Q&A train split, weighted by ``qa_fraction`` (:mod:`lmforge.train.mixture`);
    with ``alpha = 0`` the teacher is not run during training at all. ``qa_uri`` defaults to the Q&A data
    recorded in the teacher's manifest by the LoRA stage; the held-out split is the one LoRA made.

    Runs as one process, or on every rank of a ``torchrun`` / Kubeflow Trainer job (DDP, DeepSpeed ZeRO or FSDP2):
    the student is trained data-parallel, every rank runs the teacher on its own batch, and rank 0 writes the
    output. Each rank holds its own frozen copy of the teacher, or with ``teacher_sharding: fsdp2`` 1/ranks of it
    (:mod:`lmforge.train.frozen_shard`); the manifest records the teacher's bytes on the fullest rank.

    Raises:
        InputDataError: the teacher has no weights, the shards were not written by the teacher's
            tokenizer, the student base's tokenizer differs from the teacher's, or ``student`` is not empty.
    """
    student_base = student_base or None  # an unset pipeline parameter arrives as ""
    refuse_occupied(student)  # on every rank, before any of them trains
    with tempfile.TemporaryDirectory(prefix="lmforge-distill-") as workdir:
        teacher_local = localize_model(teacher, Path(workdir, "teacher"))
        shards_local = storage.localize(str(shards), Path(workdir, "shards"))
        inputs: dict[str, Any] = {
            "teacher": input_record(teacher_local) | {"uri": str(teacher)},
            "shards": input_record(shards_local) | {"uri": str(shards)},
        }
        student_local = None
        if student_base is not None:
            student_local = _load_student_base(student_base, Path(workdir, "student"), teacher_local, teacher)
            inputs["student_base"] = model_record(student_local, str(student_base))
        lineage = qa_lineage([teacher_local])
        qa = qa_uri or lineage.uri
        if qa is None:
            logger.warning("distill: no qa_uri given and none recorded in the teacher's manifest: corpus windows only")
        tokenizer = base_tokenizer(teacher_local)
        qa_rows = None
        if qa is not None:  # read for the held-out answer loss even when the mixture leaves examples out
            tcfg = cfg.train
            qa_rows = load_qa_rows(
                str(qa), tokenizer, lineage, width=tcfg.seq_len + 1, heldout_limit=tcfg.eval_batches * tcfg.batch_size
            )
            inputs["qa"] = {
                "uri": str(qa),
                "kind": "qa_examples",
                "heldout_fraction": qa_rows.heldout_fraction,
                "heldout_fraction_source": qa_rows.fraction_source,
                "train_examples": len(qa_rows.train_examples),
                "heldout_examples": len(qa_rows.heldout_examples),
            }
        return _run(cfg, teacher_local, shards_local, student_local, qa_rows, inputs, student)


def _student(cfg: DistillConfig, teacher: PreTrainedModel, student_dir: Path | None, tokenizer: Any) -> PreTrainedModel:
    if student_dir is None:
        return make_student(teacher, cfg.student_layer_fraction, cfg.init, seed=cfg.train.seed)
    student = load_causal_lm(student_dir)
    if student.config.vocab_size != teacher.config.vocab_size:
        raise InputDataError(
            f"distill: student vocabulary {student.config.vocab_size} differs from the teacher's "
            f"{teacher.config.vocab_size}; teacher and student must share a tokenizer"
        )
    positions = student.config.max_position_embeddings
    if cfg.train.seq_len > positions:
        raise ConfigError(
            f"distill.train.seq_len ({cfg.train.seq_len}) exceeds the student base's {positions} positions"
        )
    align_special_tokens(student, tokenizer)
    return student


def _mixture_record(mixture: Mixture, requested: float, qa: QARows | None, trained: dict[str, Any]) -> dict[str, Any]:
    record: dict[str, Any] = {
        "requested_qa_fraction": requested,
        "qa_fraction": mixture.qa_fraction,
        "corpus_rows_per_batch": mixture.corpus_rows,
        "example_rows_per_batch": mixture.qa_rows,
        "reason": mixture.reason,
        **trained,
    }
    if qa is not None:
        record |= {
            "qa_uri": qa.uri,
            "heldout_fraction": qa.heldout_fraction,
            "train_examples": len(qa.train_examples),
            "heldout_examples": len(qa.heldout_examples),
            "train_rows": len(qa.train),
            "split_examples": qa.split_examples,
            "rows_without_answer_tokens": qa.dropped_rows,
        }
    return record


def _teacher(teacher_dir: Path, seq_len: int) -> PreTrainedModel:
    """The teacher's weights, refused when ``seq_len`` exceeds its positions."""
    teacher = load_causal_lm(teacher_dir)
    positions = teacher.config.max_position_embeddings
    if seq_len > positions:
        raise ConfigError(f"distill.train.seq_len ({seq_len}) exceeds the teacher's {positions} positions")
    return teacher


def _frozen(teacher: PreTrainedModel, cfg: DistillConfig, device: torch.device) -> tuple[PreTrainedModel, int]:
    """The teacher only runs forward: frozen, eval mode (no dropout), half the memory in bf16 where supported;
    sharded over every rank with ``teacher_sharding: fsdp2`` when a process group runs. Returns it and its number of
    shards (1: whole on every rank)."""
    dtype = teacher_dtype(cfg.teacher_dtype, device)
    if cfg.teacher_sharding == "fsdp2" and dist.is_initialized():
        return teacher, shard_frozen(teacher, dtype, device)
    teacher.requires_grad_(False)
    return teacher.to(device=device, dtype=dtype).eval(), 1


def _teacher_record(teacher: PreTrainedModel, cfg: DistillConfig, shards: int, ctx: DistContext) -> dict[str, Any]:
    """How the teacher is held: its sharding, shard count, whole weight bytes and the bytes of the fullest rank
    (measured on the local shards; called on every rank)."""
    whole = sum(p.numel() * p.element_size() for p in teacher.parameters())  # a DTensor counts its global shape
    per_rank = max(ctx.all_gather_object(local_weight_bytes(teacher)))
    return {
        "sharding": cfg.teacher_sharding,
        "shards": shards,
        "weight_bytes": whole,
        "weight_bytes_per_rank": per_rank,
    }


def _log_plan(
    cfg: DistillConfig,
    models: tuple[PreTrainedModel, PreTrainedModel],
    parameters: tuple[int, int],
    pretrained: bool,
    mixture: Mixture,
    world_size: int,
) -> None:
    """Log what is distilled into what: ``models`` and their ``parameters`` are (teacher, student)."""
    teacher, student = models
    logger.info(
        "distilling %d-layer teacher (%.2fM, %s) into %d-layer student (%.2fM, %s), T=%g, alpha=%g, "
        "%s KL; each batch %d corpus windows + %d examples (qa_fraction %g); %d rank(s), %s",
        teacher.config.num_hidden_layers,
        parameters[0] / 1e6,
        teacher.dtype,
        student.config.num_hidden_layers,
        parameters[1] / 1e6,
        "pretrained student_base" if pretrained else f"init {cfg.init}",
        cfg.temperature,
        cfg.alpha,
        cfg.divergence,
        mixture.corpus_rows,
        mixture.qa_rows,
        mixture.qa_fraction,
        world_size,
        describe_backend(cfg.train.distributed),
    )


def _log_teacher(record: dict[str, Any]) -> None:
    logger.info(
        "teacher %s over %d shard(s): %.1f MB of its %.1f MB of weights on the fullest rank",
        record["sharding"],
        record["shards"],
        record["weight_bytes_per_rank"] / 1e6,
        record["weight_bytes"] / 1e6,
    )


def _kd_loss(cfg: DistillConfig, teacher: PreTrainedModel, kd: ChunkedKDLoss, mixture: Mixture) -> LossFn:
    """The training loss: KD on the teacher's logits (plain CE with ``alpha = 0``), combined over the mixture."""

    def loss_fn(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, Any]:
        ids, targets = batch["input_ids"], batch["targets"]
        teacher_logits = None
        # alpha = 0 is plain next-token training: the teacher's logits would be multiplied by 0. Otherwise every
        # rank runs the teacher once per micro-batch, which a sharded teacher's all-gathers need.
        if cfg.alpha > 0:
            with torch.no_grad():
                teacher_logits = teacher(input_ids=ids, use_cache=False).logits
        student_logits = model(input_ids=ids, use_cache=False).logits

        def part(rows: slice) -> tuple[torch.Tensor, Any]:
            if teacher_logits is None:
                return masked_ce(student_logits[rows], targets[rows]), targets[rows].ne(IGNORE_INDEX).sum()
            terms = kd(student_logits[rows], teacher_logits[rows], targets[rows])
            return terms.total, terms.n_tokens

        return mixture.combine(part, batch["corpus_rows"])

    return loss_fn


def _kl_loss(teacher: PreTrainedModel, kd: ChunkedKDLoss) -> LossFn:
    """``(KL of the student from the teacher, scored tokens)`` of a batch, for :func:`evaluate`."""

    def kl_fn(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
        with torch.no_grad():
            teacher_logits = teacher(input_ids=batch["input_ids"], use_cache=False).logits
        student_logits = model(input_ids=batch["input_ids"], use_cache=False).logits
        terms: KDTerms = kd(student_logits, teacher_logits, batch["targets"])
        return terms.kl, int(batch["targets"].ne(IGNORE_INDEX).sum())

    return kl_fn


@dataclasses.dataclass
class _Scores:
    """The trained student measured against the teacher (on every rank: a ZeRO-3 student's forward needs all)."""

    teacher_val: float
    kl: float
    answer_losses: dict[str, float]


def _score(
    student: torch.nn.Module,
    teacher: PreTrainedModel,
    kd: ChunkedKDLoss,
    val_batches: Any,
    heldout: list,
    precision: str,
) -> _Scores:
    teacher_val = evaluate(teacher, causal_lm_loss, val_batches, precision=precision)
    kl = evaluate(student, _kl_loss(teacher, kd), val_batches, precision=precision)
    answer_losses = {}
    if heldout:
        for name, model in (("student", student), ("teacher", teacher)):
            answer_losses[name] = evaluate(model, causal_lm_loss, heldout, precision=precision)
    return _Scores(teacher_val, kl, answer_losses)


def _metrics(
    history: dict[str, Any], scores: _Scores, parameters: int, teacher_parameters: int, mixture: Mixture
) -> dict[str, float]:
    student_val = history["eval_loss"][-1]
    metrics = {
        "student_val_loss": student_val,
        "teacher_val_loss": scores.teacher_val,
        "student_val_perplexity": math.exp(student_val),
        "teacher_val_perplexity": math.exp(scores.teacher_val),
        "kl": scores.kl,
        "train_loss": history["train_loss"][-1],
        "parameters": float(parameters),
        "parameter_fraction": parameters / teacher_parameters,
        "tokens_per_sec": tokens_per_sec(history),
        "qa_fraction": mixture.qa_fraction,
    }
    for name, loss in scores.answer_losses.items():
        metrics[f"{name}_heldout_answer_loss"] = loss
    return metrics | quarantine_facts(history)[0]


def _log_result(metrics: dict[str, float], scores: _Scores) -> None:
    logger.info(
        "distill: student val loss %.4f, teacher %.4f, KL %.4f; held-out answer loss student %s, teacher %s",
        metrics["student_val_loss"],
        scores.teacher_val,
        scores.kl,
        *(f"{scores.answer_losses[n]:.4f}" if n in scores.answer_losses else "n/a" for n in ("student", "teacher")),
    )


def _report(
    cfg: DistillConfig,
    history: dict[str, Any],
    record: dict[str, Any],
    metrics: dict[str, float],
    layers: tuple[int, int],
    mixture: Mixture,
) -> str:
    return page(
        "Distillation",
        [
            *curves_section(history, title="Student loss (train: KD objective, eval: next-token CE)"),
            ("Training mixture", table(["figure", "value"], [[k, v] for k, v in record.items() if v is not None])),
            ("Metrics", table(["metric", "value"], list(metrics.items()))),
        ],
        subtitle=f"{layers[0]}-layer student of a {layers[1]}-layer teacher, T={cfg.temperature}, "
        f"alpha={cfg.alpha}, {cfg.divergence} KL, qa_fraction {mixture.qa_fraction:g}",
    )


def _run(
    cfg: DistillConfig,
    teacher_dir: Path,
    shards_dir: Path,
    student_dir: Path | None,
    qa: QARows | None,
    inputs: dict[str, Any],
    output_dir: str | Path,
) -> StageResult:
    tcfg = cfg.train
    shards = open_matching_shards(shards_dir, teacher_dir)
    tokenizer = base_tokenizer(teacher_dir)
    pad_id = tokenizer.pad_token_id
    teacher = _teacher(teacher_dir, tcfg.seq_len)
    mixture = plan_mixture(cfg.qa_fraction, tcfg.batch_size, qa)
    heldout = heldout_batches(qa, pad_id, tcfg.batch_size) if qa is not None and qa.heldout else []

    with distributed_context(tcfg.distributed) as ctx, main_rank_outputs(ctx, output_dir) as (out,):
        train_batch, val_batches = mixture_batches(
            shards, tcfg, mixture, qa, pad_id, rank=ctx.data_rank, world_size=ctx.data_ranks
        )
        student = _student(cfg, teacher, student_dir, tokenizer).to(device=ctx.device, dtype=torch.float32)
        teacher, shards = _frozen(teacher, cfg, ctx.device)
        parameters, teacher_parameters = count_parameters(student), count_parameters(teacher)
        teacher_record = _teacher_record(teacher, cfg, shards, ctx)
        if ctx.is_main:
            models = (teacher, student)
            _log_plan(cfg, models, (teacher_parameters, parameters), student_dir is not None, mixture, ctx.world_size)
            _log_teacher(teacher_record)
        kd = ChunkedKDLoss(
            temperature=cfg.temperature, alpha=cfg.alpha, divergence=cfg.divergence, chunk_tokens=cfg.chunk_tokens
        )
        # Validation reports the student's plain next-token loss on corpus windows, comparable with the teacher's.
        # DDP / DeepSpeed / FSDP2 wrap the student only; the teacher stays frozen, whole or sharded, on each rank.
        history = train(
            student, tcfg, _kd_loss(cfg, teacher, kd, mixture), train_batch, lambda: val_batches,
            eval_loss_fn=causal_lm_loss, desc="distill", dist=ctx,
            flops_per_token=distillation_model_flops_per_token(student, teacher, tcfg.seq_len),
        )  # fmt: skip
        scores = _score(student, teacher, kd, val_batches, heldout, tcfg.precision)
        student_config = student.config
        student = whole_model(student, ctx, lambda: AutoModelForCausalLM.from_config(student_config).float())
        if out is None:
            return StageResult(summary={"model_dir": str(output_dir), "rank": ctx.rank})

        metrics = _metrics(history, scores, parameters, teacher_parameters, mixture) | scale_metrics(
            history, ctx.world_size
        )
        record = _mixture_record(mixture, cfg.qa_fraction, qa, trained_on(mixture, qa, tcfg, ctx.world_size))
        save_model_dir(student, tokenizer, out, history=history)
        write_manifest(
            out,
            "model",
            inputs=inputs,
            config=cfg.model_dump(mode="json"),
            metrics=metrics,
            extra={"mixture": record, "teacher": teacher_record},
        )
    _log_result(metrics, scores)
    layers = (student.config.num_hidden_layers, teacher.config.num_hidden_layers)
    html = _report(cfg, history, record, metrics, layers, mixture)
    summary = {"model_dir": str(output_dir), "mixture": record, **quarantine_facts(history)[1]}
    return StageResult(metrics=metrics, html=html, summary=summary)
