"""The ``pretrain`` stage: a causal LM trained on token shards, freshly initialized or continued from a base model.

Runs as one process, or on every rank of a ``torchrun`` / Kubeflow Trainer job (DDP or DeepSpeed ZeRO,
see :class:`~lmforge.config.DistributedConfig`); rank 0 writes the output model directory.

With a base model (a Hugging Face directory, local or ``s3://``, see :mod:`lmforge.model.base`) its
architecture and shape come from its ``config.json`` (``model`` of the config does not apply) and its
weights are where training starts; the shards must have been written with the base's tokenizer
(``tokenize`` with the same base). ``train.max_steps: 0`` passes the base through untrained: the output is
the base's weights with the tokenizer artifact, its special-token ids aligned to that tokenizer, and an
lmforge manifest with its validation loss.
"""

from __future__ import annotations

import logging
import math
import tempfile
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from lmforge.artifacts import input_record, write_manifest
from lmforge.config import PretrainConfig, TrainConfig
from lmforge.errors import ConfigError, InputDataError
from lmforge.formats.token_shards import TokenShards
from lmforge.model.base import (
    align_special_tokens,
    base_tokenizer,
    localize_base,
    model_record,
    tokenizer_mismatch,
)
from lmforge.model.build import FUSED_GPT2_GELU, build_model, load_causal_lm, save_model_dir, set_gpt2_activation
from lmforge.report_html import page, table
from lmforge.results import StageResult
from lmforge.train.batches import open_matching_shards, shard_batches
from lmforge.train.deepspeed_config import hf_zero3_init
from lmforge.train.distributed import describe_backend, distributed_context, main_rank_outputs, refuse_occupied
from lmforge.train.loop import (
    curves_section,
    evaluate,
    quarantine_facts,
    scale_metrics,
    tokens_per_sec,
    train,
    whole_model,
)
from lmforge.train.losses import causal_lm_loss
from lmforge.train.mfu import model_flops_per_token

logger = logging.getLogger("lmforge.pretrain")

TENSORBOARD_DIR = "tensorboard"


def run(
    cfg: PretrainConfig,
    *,
    shards: str | Path,
    tokenizer: str | Path,
    model: str | Path,
    base_model: str | Path | None = None,
) -> StageResult:
    """Pretrain on the shards' train split (``cfg.model`` from scratch, or ``base_model`` continued); write an HF
    model directory to ``model``.

    With ``cfg.train.checkpoint.dir`` set, training resumes from the newest complete checkpoint there
    and writes new ones as configured.

    Raises:
        InputDataError: the shards were not written by ``tokenizer``, the tokenizer is not the base's, the
            base cannot be handled, a split is shorter than one training window, or ``model`` is not empty.
        ConfigError: ``train.max_steps`` is 0 without a base model, or seq_len exceeds the base's positions.
        TrainingPreempted: SIGTERM arrived; the final checkpoint is in ``cfg.train.checkpoint.dir``.
        NonFiniteLossError: too many consecutive non-finite steps.
    """
    base_model = base_model or None  # an unset pipeline parameter arrives as ""
    if base_model is None and cfg.train.max_steps == 0:
        raise ConfigError(
            "pretrain.train.max_steps is 0, which passes a base model through untrained, but no base model was given"
        )
    token_shards = open_matching_shards(shards, tokenizer)
    tok = base_tokenizer(tokenizer)
    inputs: dict[str, Any] = {"shards": input_record(shards), "tokenizer": input_record(tokenizer)}
    refuse_occupied(model)
    with tempfile.TemporaryDirectory(prefix="lmforge-pretrain-") as workdir:
        base_dir = None
        if base_model is not None:
            base_dir = localize_base(base_model, workdir)
            if mismatch := tokenizer_mismatch(tok, base_tokenizer(base_dir)):
                raise InputDataError(
                    f"pretrain: tokenizer {tokenizer} is not the base model {base_model}'s ({mismatch}); "
                    "tokenize the corpus with the same base_model"
                )
            inputs["base_model"] = model_record(base_dir, str(base_model))
        return _run(cfg, token_shards, tok, base_dir, inputs, model)


def _starting_model(cfg: PretrainConfig, tok: PreTrainedTokenizerBase, base_dir: Path | None) -> PreTrainedModel:
    """The model training starts from: ``cfg.model`` freshly initialized, or the base's weights."""
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if base_dir is None:
        return build_model(cfg.model, len(tok), eos_id=tok.eos_token_id, pad_id=pad_id, seed=cfg.train.seed)
    lm = load_causal_lm(base_dir)
    align_special_tokens(lm, tok)
    if lm.config.model_type == "gpt2" and lm.config.activation_function == "gelu_new":
        set_gpt2_activation(lm, FUSED_GPT2_GELU)  # the same function in one fused kernel (see build.hf_config)
    positions = lm.config.max_position_embeddings
    if cfg.train.seq_len > positions:
        raise ConfigError(
            f"pretrain.train.seq_len ({cfg.train.seq_len}) exceeds the base model's {positions} positions"
        )
    return lm


def _log_plan(
    config: PretrainedConfig,
    parameters: int,
    tcfg: TrainConfig,
    token_shards: TokenShards,
    world_size: int,
    continuing: bool,
) -> None:
    logger.info(
        "%s %s (%d layers, %.2fM parameters) for %d steps on %d train tokens, %d rank(s), %s",
        "continuing the base model" if continuing else "pretraining",
        config.model_type,
        config.num_hidden_layers,
        parameters / 1e6,
        tcfg.max_steps,
        token_shards.index["splits"]["train"]["tokens"],
        world_size,
        describe_backend(tcfg.distributed),
    )


def _metrics(
    val_loss: float, parameters: int, tcfg: TrainConfig, world_size: int, history: dict[str, Any] | None
) -> dict[str, float]:
    metrics = {
        "val_loss": val_loss,
        "val_perplexity": math.exp(val_loss),
        "parameters": float(parameters),
        "steps": float(tcfg.max_steps),
    } | scale_metrics(history, world_size)
    if history is None:
        return metrics
    metrics |= {
        "train_loss": history["train_loss"][-1],
        "tokens_per_sec": tokens_per_sec(history),
        "bad_steps": float(history["bad_steps"]),
    }
    return metrics | quarantine_facts(history)[0]


def _report(
    config: PretrainedConfig,
    parameters: int,
    history: dict[str, Any] | None,
    metrics: dict[str, float],
    base: str | None,
) -> str:
    """The stage's HTML report; ``base`` is the base model's URI when training continued one."""
    shape = f"{config.model_type}, {config.num_hidden_layers} layers, {parameters / 1e6:.2f}M parameters"
    return page(
        "Pretraining",
        [
            *(curves_section(history) if history is not None else []),
            ("Metrics", table(["metric", "value"], list(metrics.items()))),
        ],
        subtitle=shape if base is None else f"{shape}, from base model {base}",
    )


def _run(
    cfg: PretrainConfig,
    token_shards: TokenShards,
    tok: PreTrainedTokenizerBase,
    base_dir: Path | None,
    inputs: dict[str, Any],
    model: str | Path,
) -> StageResult:
    tcfg = cfg.train
    with distributed_context(tcfg.distributed) as ctx, main_rank_outputs(ctx, model) as (out,):
        train_batch, val_batches = shard_batches(token_shards, tcfg, rank=ctx.data_rank, world_size=ctx.data_ranks)
        with hf_zero3_init(tcfg, ctx.world_size):
            lm = _starting_model(cfg, tok, base_dir)
            config = lm.config
            if not any(hasattr(p, "ds_id") for p in lm.parameters()):  # not partitioned
                lm = lm.to(ctx.device)
            parameters = sum(getattr(p, "ds_numel", p.numel()) for p in lm.parameters())
            if ctx.is_main:
                _log_plan(config, parameters, tcfg, token_shards, ctx.world_size, continuing=base_dir is not None)
            history = None
            if tcfg.max_steps == 0:
                val_loss = evaluate(lm, causal_lm_loss, val_batches, precision=tcfg.precision)
            else:
                history = train(
                    lm, tcfg, causal_lm_loss, train_batch, lambda: val_batches, desc="pretrain", dist=ctx,
                    flops_per_token=model_flops_per_token(lm, tcfg.seq_len),
                    tensorboard_dir=out / TENSORBOARD_DIR if out is not None else None,
                )  # fmt: skip
                val_loss = history["eval_loss"][-1]
        # outside hf_zero3_init: the plain copy of ZeRO-3 weights must not be partitioned again
        lm = whole_model(lm, ctx, lambda: AutoModelForCausalLM.from_config(config))
        if out is None:
            return StageResult(summary={"model_dir": str(model), "rank": ctx.rank})

        metrics = _metrics(val_loss, parameters, tcfg, ctx.world_size, history)
        summary: dict[str, Any] = {"model_dir": str(model), "base_model": inputs.get("base_model", {}).get("uri")}
        if history is not None:
            summary |= quarantine_facts(history)[1]
        save_model_dir(lm.cpu(), tok, out, history=history)
        write_manifest(
            out,
            "model",
            inputs=inputs,
            config=cfg.model_dump(mode="json"),
            metrics=metrics,
            extra={"passed_through": history is None},
        )
    logger.info(
        "pretrain: %s, val loss %.4f (perplexity %.1f) -> %s",
        "base model passed through untrained" if history is None else f"{tcfg.max_steps} steps",
        val_loss,
        metrics["val_perplexity"],
        model,
    )
    html = _report(config, parameters, history, metrics, summary["base_model"] if base_dir is not None else None)
    return StageResult(metrics=metrics, html=html, summary=summary)
