"""The ``pretrain`` stage: a freshly initialized causal LM trained on token shards.

Runs as one process, or on every rank of a ``torchrun`` / Kubeflow Trainer job (DDP or DeepSpeed ZeRO,
see :class:`~lmforge.config.DistributedConfig`); rank 0 writes the output model directory.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from lmforge.artifacts import input_record, write_manifest
from lmforge.config import PretrainConfig
from lmforge.model.build import build_model, load_tokenizer, save_model_dir
from lmforge.report_html import page, table
from lmforge.results import StageResult
from lmforge.train.batches import open_matching_shards, shard_batches
from lmforge.train.deepspeed_config import hf_zero3_init
from lmforge.train.distributed import describe_backend, distributed_context, main_rank_outputs, refuse_occupied
from lmforge.train.loop import curves_section, quarantine_facts, tokens_per_sec, train, whole_model
from lmforge.train.losses import causal_lm_loss
from lmforge.train.mfu import model_flops_per_token

logger = logging.getLogger("lmforge.pretrain")

TENSORBOARD_DIR = "tensorboard"


def run(cfg: PretrainConfig, *, shards: str | Path, tokenizer: str | Path, model: str | Path) -> StageResult:
    """Pretrain ``cfg.model`` on the shards' train split; write an HF model directory to ``model``.

    With ``cfg.train.checkpoint.dir`` set, training resumes from the newest complete checkpoint there
    and writes new ones as configured.

    Raises:
        InputDataError: the shards were not written by ``tokenizer``, a split is shorter than one
            training window, or ``model`` is not empty.
        TrainingPreempted: SIGTERM arrived; the final checkpoint is in ``cfg.train.checkpoint.dir``.
        NonFiniteLossError: too many consecutive non-finite steps.
    """
    tcfg = cfg.train
    token_shards = open_matching_shards(shards, tokenizer)
    tok = load_tokenizer(tokenizer)
    inputs = {"shards": input_record(shards), "tokenizer": input_record(tokenizer)}
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    refuse_occupied(model)

    with distributed_context(tcfg.distributed) as ctx, main_rank_outputs(ctx, model) as (out,):
        train_batch, val_batches = shard_batches(token_shards, tcfg, rank=ctx.rank, world_size=ctx.world_size)
        with hf_zero3_init(tcfg, ctx.world_size):
            lm = build_model(cfg.model, len(tok), eos_id=tok.eos_token_id, pad_id=pad_id, seed=tcfg.seed)
            partitioned = any(hasattr(p, "ds_id") for p in lm.parameters())
            if not partitioned:
                lm = lm.to(ctx.device)
            parameters = sum(getattr(p, "ds_numel", p.numel()) for p in lm.parameters())
            if ctx.is_main:
                logger.info(
                    "pretraining %s (%d layers, %.2fM parameters) for %d steps on %d train tokens, %d rank(s), %s",
                    cfg.model.arch,
                    cfg.model.n_layer,
                    parameters / 1e6,
                    tcfg.max_steps,
                    token_shards.index["splits"]["train"]["tokens"],
                    ctx.world_size,
                    describe_backend(tcfg.distributed),
                )
            history = train(
                lm,
                tcfg,
                causal_lm_loss,
                train_batch,
                lambda: val_batches,
                desc="pretrain",
                dist=ctx,
                flops_per_token=model_flops_per_token(lm, tcfg.seq_len),
                tensorboard_dir=out / TENSORBOARD_DIR if out is not None else None,
            )
        # outside hf_zero3_init: the plain copy of ZeRO-3 weights must not be partitioned again
        lm = whole_model(
            lm,
            ctx,
            lambda: build_model(cfg.model, len(tok), eos_id=tok.eos_token_id, pad_id=pad_id, seed=0),
        )
        if out is None:
            return StageResult(summary={"model_dir": str(model), "rank": ctx.rank})

        val_loss = history["eval_loss"][-1]
        metrics = {
            "train_loss": history["train_loss"][-1],
            "val_loss": val_loss,
            "val_perplexity": math.exp(val_loss),
            "tokens_per_sec": tokens_per_sec(history),
            "parameters": float(parameters),
            "steps": float(tcfg.max_steps),
            "bad_steps": float(history["bad_steps"]),
            "world_size": float(ctx.world_size),
        }
        moved_metrics, moved_summary = quarantine_facts(history)
        metrics |= moved_metrics
        if history["mfu"] and history["mfu"][-1] is not None:
            metrics["mfu"] = history["mfu"][-1]
        save_model_dir(lm.cpu(), tok, out, history=history)
        write_manifest(out, "model", inputs=inputs, config=cfg.model_dump(mode="json"), metrics=metrics)
    logger.info("pretrain: val loss %.4f (perplexity %.1f) -> %s", val_loss, metrics["val_perplexity"], model)

    html = page(
        "Pretraining",
        [*curves_section(history), ("Metrics", table(["metric", "value"], list(metrics.items())))],
        subtitle=f"{cfg.model.arch}, {cfg.model.n_layer} layers, {parameters / 1e6:.2f}M parameters",
    )
    return StageResult(metrics=metrics, html=html, summary={"model_dir": str(model), **moved_summary})
