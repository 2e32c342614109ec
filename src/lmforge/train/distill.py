"""The ``distill`` stage: a shallower student trained on the teacher's soft targets over token shards."""

from __future__ import annotations

import copy
import logging
import math
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from lmforge import storage
from lmforge.artifacts import input_record, write_manifest
from lmforge.config import DistillConfig
from lmforge.data.tokenizer import tokenizer_fingerprint
from lmforge.errors import ConfigError, InputDataError
from lmforge.model.build import check_model_dir, count_parameters, load_causal_lm, load_tokenizer, save_model_dir
from lmforge.report_html import page, table
from lmforge.results import StageResult
from lmforge.train.batches import IGNORE_INDEX, open_matching_shards, shard_batches
from lmforge.train.distributed import describe_backend, distributed_context, main_rank_outputs, refuse_occupied
from lmforge.train.loop import curves_section, evaluate, quarantine_facts, tokens_per_sec, train, whole_model
from lmforge.train.losses import ChunkedKDLoss, KDTerms, causal_lm_loss

logger = logging.getLogger("lmforge.distill")

# Where each architecture keeps its list of transformer blocks in the state dict.
BLOCK_PREFIXES = {"gpt2": "transformer.h.", "llama": "model.layers."}


def student_layers(n_teacher: int, fraction: float) -> list[int]:
    """Teacher block indices the student's blocks come from: ``m = max(1, round(fraction·n))`` blocks,
    block ``i`` from teacher block ``floor(i·n/m)`` (every k-th block when ``m`` divides ``n``)."""
    m = max(1, round(fraction * n_teacher))
    return [i * n_teacher // m for i in range(m)]


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


def check_same_tokenizer(teacher_dir: Path, student_dir: Path, *, teacher_uri: str, student_uri: str) -> None:
    """Raise a one-line error unless both model directories hold the same tokenizer (same ``tokenizer.json``)."""
    teacher_tok, student_tok = load_tokenizer(teacher_dir), load_tokenizer(student_dir)
    teacher_fp, student_fp = tokenizer_fingerprint(teacher_dir), tokenizer_fingerprint(student_dir)
    if teacher_fp != student_fp:
        raise InputDataError(
            f"distill: tokenizer mismatch: student {student_uri} has tokenizer {student_fp[:12]} "
            f"({len(student_tok)} tokens), teacher {teacher_uri} has {teacher_fp[:12]} ({len(teacher_tok)} tokens); "
            "teacher and student must share a tokenizer"
        )


def _localize_model(uri: str | Path, workdir: Path) -> Path:
    local = storage.localize(str(uri), workdir)
    try:
        return check_model_dir(local)
    except InputDataError as exc:  # name the URI the user gave, not the scratch copy
        raise InputDataError(str(exc).replace(str(local), str(uri))) from exc


def run(cfg: DistillConfig, *, teacher: str | Path, shards: str | Path, student: str | Path) -> StageResult:
    """Distill the teacher into a student with ``student_layer_fraction`` of its blocks (or ``student_uri``).

    The teacher and the student may be local directories or ``s3://`` prefixes. The teacher is frozen
    (eval mode, no grad, bf16 where supported); the student is trained on
    ``alpha·T²·KL + (1 − alpha)·CE`` (:class:`~lmforge.train.losses.ChunkedKDLoss`); with ``alpha = 0``
    the teacher is not run during training at all.

    Runs as one process, or on every rank of a ``torchrun`` / Kubeflow Trainer job (DDP or DeepSpeed ZeRO):
    the student is trained data-parallel, every rank runs its own frozen copy of the teacher, and rank 0
    writes the output.

    Raises:
        InputDataError: the teacher has no weights, the shards were not written by the teacher's
            tokenizer, the student's tokenizer differs from the teacher's, or ``student`` is not empty.
    """
    refuse_occupied(student)  # on every rank, before any of them trains
    with tempfile.TemporaryDirectory(prefix="lmforge-distill-") as workdir:
        teacher_local = _localize_model(teacher, Path(workdir, "teacher"))
        shards_local = storage.localize(str(shards), Path(workdir, "shards"))
        student_local = None
        if cfg.student_uri is not None:
            student_local = _localize_model(cfg.student_uri, Path(workdir, "student"))
            check_same_tokenizer(teacher_local, student_local, teacher_uri=str(teacher), student_uri=cfg.student_uri)
        inputs = {
            "teacher": input_record(teacher_local) | {"uri": str(teacher)},
            "shards": input_record(shards_local) | {"uri": str(shards)},
        }
        if student_local is not None:
            inputs["student"] = {"uri": cfg.student_uri, "kind": "model"}
        return _run(cfg, teacher_local, shards_local, student_local, inputs, student)


def _run(
    cfg: DistillConfig,
    teacher_dir: Path,
    shards_dir: Path,
    student_dir: Path | None,
    inputs: dict[str, Any],
    output_dir: str | Path,
) -> StageResult:
    tcfg = cfg.train
    shards = open_matching_shards(shards_dir, teacher_dir)
    tokenizer = load_tokenizer(teacher_dir)
    teacher = load_causal_lm(teacher_dir)
    positions = teacher.config.max_position_embeddings
    if tcfg.seq_len > positions:
        raise ConfigError(f"distill.train.seq_len ({tcfg.seq_len}) exceeds the teacher's {positions} positions")

    with distributed_context(tcfg.distributed) as ctx, main_rank_outputs(ctx, output_dir) as (out,):
        train_batch, val_batches = shard_batches(shards, tcfg, rank=ctx.rank, world_size=ctx.world_size)
        device = ctx.device
        if student_dir is not None:
            student = load_causal_lm(student_dir)
            if student.config.vocab_size != teacher.config.vocab_size:
                raise InputDataError(
                    f"distill: student vocabulary {student.config.vocab_size} differs from the teacher's "
                    f"{teacher.config.vocab_size}; teacher and student must share a tokenizer"
                )
        else:
            student = make_student(teacher, cfg.student_layer_fraction, cfg.init, seed=tcfg.seed)
        student = student.to(device=device, dtype=torch.float32)
        # The teacher only runs forward: frozen, eval mode (no dropout), half the memory in bf16 where supported.
        teacher.requires_grad_(False)
        teacher = teacher.to(device=device, dtype=teacher_dtype(cfg.teacher_dtype, device)).eval()
        parameters, teacher_parameters = count_parameters(student), count_parameters(teacher)
        if ctx.is_main:
            logger.info(
                "distilling %d-layer teacher (%.2fM, %s) into %d-layer student (%.2fM, init %s), T=%g, alpha=%g, "
                "%s KL; %d rank(s), %s",
                teacher.config.num_hidden_layers,
                teacher_parameters / 1e6,
                teacher.dtype,
                student.config.num_hidden_layers,
                parameters / 1e6,
                cfg.init,
                cfg.temperature,
                cfg.alpha,
                cfg.divergence,
                ctx.world_size,
                describe_backend(tcfg.distributed),
            )
        kd = ChunkedKDLoss(
            temperature=cfg.temperature, alpha=cfg.alpha, divergence=cfg.divergence, chunk_tokens=cfg.chunk_tokens
        )

        def kd_terms(model: torch.nn.Module, batch: dict[str, Any]) -> KDTerms:
            with torch.no_grad():
                teacher_logits = teacher(input_ids=batch["input_ids"], use_cache=False).logits
            student_logits = model(input_ids=batch["input_ids"], use_cache=False).logits
            return kd(student_logits, teacher_logits, batch["targets"])

        def loss_fn(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
            terms = kd_terms(model, batch)
            return terms.total, terms.n_tokens

        # alpha = 0 is plain next-token training: the teacher's logits would be multiplied by zero.
        train_loss_fn = causal_lm_loss if cfg.alpha == 0 else loss_fn
        # Validation reports the student's plain next-token loss, comparable with the teacher's.
        # DDP / DeepSpeed wrap the student only; the teacher stays a plain frozen module on each rank.
        history = train(
            student, tcfg, train_loss_fn, train_batch, lambda: val_batches, eval_loss_fn=causal_lm_loss,
            desc="distill", dist=ctx,
        )  # fmt: skip
        # on every rank: a ZeRO-3 student's forward needs all ranks
        teacher_val = evaluate(teacher, causal_lm_loss, val_batches, precision=tcfg.precision)
        kl = evaluate(
            student, lambda m, b: (kd_terms(m, b).kl, int(b["targets"].ne(IGNORE_INDEX).sum())), val_batches,
            precision=tcfg.precision,
        )  # fmt: skip
        student_config = student.config
        student = whole_model(student, ctx, lambda: AutoModelForCausalLM.from_config(student_config).float())
        if out is None:
            return StageResult(summary={"model_dir": str(output_dir), "rank": ctx.rank})

        student_val = history["eval_loss"][-1]
        metrics = {
            "student_val_loss": student_val,
            "teacher_val_loss": teacher_val,
            "student_val_perplexity": math.exp(student_val),
            "teacher_val_perplexity": math.exp(teacher_val),
            "kl": kl,
            "train_loss": history["train_loss"][-1],
            "parameters": float(parameters),
            "parameter_fraction": parameters / teacher_parameters,
            "tokens_per_sec": tokens_per_sec(history),
        }
        moved_metrics, moved_summary = quarantine_facts(history)
        metrics |= moved_metrics
        save_model_dir(student, tokenizer, out, history=history)
        write_manifest(out, "model", inputs=inputs, config=cfg.model_dump(mode="json"), metrics=metrics)
    logger.info("distill: student val loss %.4f, teacher %.4f, KL %.4f", student_val, teacher_val, kl)

    html = page(
        "Distillation",
        [
            *curves_section(history, title="Student loss (train: KD objective, eval: next-token CE)"),
            ("Metrics", table(["metric", "value"], list(metrics.items()))),
        ],
        subtitle=f"{student.config.num_hidden_layers}-layer student of a "
        f"{teacher.config.num_hidden_layers}-layer teacher, T={cfg.temperature}, alpha={cfg.alpha}, "
        f"{cfg.divergence} KL",
    )
    return StageResult(metrics=metrics, html=html, summary={"model_dir": str(output_dir), **moved_summary})
