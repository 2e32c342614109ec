"""The ``distill`` stage: a shallower student trained on the teacher's soft targets over token shards."""

from __future__ import annotations

import copy
import logging
import math
import re
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from lmforge.artifacts import input_record, staged_output, write_manifest
from lmforge.config import DistillConfig
from lmforge.errors import ConfigError
from lmforge.model.build import count_parameters, load_causal_lm, load_tokenizer, save_model_dir
from lmforge.report_html import page, table
from lmforge.results import StageResult
from lmforge.train.batches import open_matching_shards, shard_batches
from lmforge.train.loop import curves_section, default_device, evaluate, tokens_per_sec, train
from lmforge.train.losses import causal_lm_loss, kd_loss

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
    return student.to(teacher.dtype)


def run(cfg: DistillConfig, teacher_dir: str | Path, shards_dir: str | Path, output_dir: str | Path) -> StageResult:
    """Distill the teacher into a student with ``student_layer_fraction`` of its blocks.

    Raises:
        InputDataError: the shards were not written by the teacher's tokenizer.
    """
    tcfg = cfg.train
    shards = open_matching_shards(shards_dir, teacher_dir)
    tokenizer = load_tokenizer(teacher_dir)
    teacher = load_causal_lm(teacher_dir)
    positions = teacher.config.max_position_embeddings
    if tcfg.seq_len > positions:
        raise ConfigError(f"distill.train.seq_len ({tcfg.seq_len}) exceeds the teacher's {positions} positions")
    inputs = {"teacher": input_record(teacher_dir), "shards": input_record(shards_dir)}
    train_batch, val_batches = shard_batches(shards, tcfg)

    with staged_output(output_dir) as out:  # entered first: an occupied output fails before training
        device = default_device()
        teacher.requires_grad_(False)
        teacher = teacher.to(device).eval()
        student = make_student(teacher, cfg.student_layer_fraction, cfg.init, seed=tcfg.seed).to(device)
        parameters = count_parameters(student)
        logger.info(
            "distilling %d-layer teacher (%.2fM) into %d-layer student (%.2fM, init %s), T=%g, alpha=%g",
            teacher.config.num_hidden_layers,
            count_parameters(teacher) / 1e6,
            student.config.num_hidden_layers,
            parameters / 1e6,
            cfg.init,
            cfg.temperature,
            cfg.alpha,
        )

        def kd_terms(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, ...]:
            with torch.no_grad():
                teacher_logits = teacher(input_ids=batch["input_ids"], use_cache=False).logits
            student_logits = model(input_ids=batch["input_ids"], use_cache=False).logits
            return kd_loss(
                student_logits, teacher_logits, batch["targets"], temperature=cfg.temperature, alpha=cfg.alpha
            )

        def loss_fn(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
            return kd_terms(model, batch)[0], batch["targets"].numel()

        # Validation reports the student's plain next-token loss, comparable with the teacher's.
        history = train(
            student, tcfg, loss_fn, train_batch, lambda: val_batches, eval_loss_fn=causal_lm_loss, desc="distill"
        )
        teacher_val = evaluate(teacher, causal_lm_loss, val_batches, precision=tcfg.precision)
        kl = evaluate(
            student, lambda m, b: (kd_terms(m, b)[1], b["targets"].numel()), val_batches, precision=tcfg.precision
        )

        student_val = history["eval_loss"][-1]
        metrics = {
            "student_val_loss": student_val,
            "teacher_val_loss": teacher_val,
            "student_val_perplexity": math.exp(student_val),
            "kl": kl,
            "parameters": float(parameters),
            "tokens_per_sec": tokens_per_sec(history),
        }
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
        f"{teacher.config.num_hidden_layers}-layer teacher, T={cfg.temperature}, alpha={cfg.alpha}",
    )
    return StageResult(metrics=metrics, html=html, summary={"model_dir": str(output_dir)})
