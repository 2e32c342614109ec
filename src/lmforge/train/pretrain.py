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


def run(cfg: PretrainConfig, shards_dir: str | Path, tokenizer_dir: str | Path, output_dir: str | Path) -> StageResult:
    """Pretrain ``cfg.model`` on the shards' train split; write an HF model directory to ``output_dir``.

    With ``cfg.train.checkpoint.dir`` set, training resumes from the newest complete checkpoint there
    and writes new ones as configured.

    Raises:
        InputDataError: the shards were not written by the tokenizer in ``tokenizer_dir``, a split is
            shorter than one training window, or ``output_dir`` is not empty.
        TrainingPreempted: SIGTERM arrived; the final checkpoint is in ``cfg.train.checkpoint.dir``.
        NonFiniteLossError: too many consecutive non-finite steps.
    """
    tcfg = cfg.train
    shards = open_matching_shards(shards_dir, tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    inputs = {"shards": input_record(shards_dir), "tokenizer": input_record(tokenizer_dir)}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    refuse_occupied(output_dir)

    with distributed_context(tcfg.distributed) as ctx, main_rank_outputs(ctx, output_dir) as (out,):
        train_batch, val_batches = shard_batches(shards, tcfg, rank=ctx.rank, world_size=ctx.world_size)
        with hf_zero3_init(tcfg, ctx.world_size):
            model = build_model(cfg.model, len(tokenizer), eos_id=tokenizer.eos_token_id, pad_id=pad_id, seed=tcfg.seed)
            partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
            if not partitioned:
                model = model.to(ctx.device)
            parameters = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
            if ctx.is_main:
                logger.info(
                    "pretraining %s (%d layers, %.2fM parameters) for %d steps on %d train tokens, %d rank(s), %s",
                    cfg.model.arch,
                    cfg.model.n_layer,
                    parameters / 1e6,
                    tcfg.max_steps,
                    shards.index["splits"]["train"]["tokens"],
                    ctx.world_size,
                    describe_backend(tcfg.distributed),
                )
            history = train(
                model,
                tcfg,
                causal_lm_loss,
                train_batch,
                lambda: val_batches,
                desc="pretrain",
                dist=ctx,
                flops_per_token=model_flops_per_token(model, tcfg.seq_len),
                tensorboard_dir=out / TENSORBOARD_DIR if out is not None else None,
            )
        # outside hf_zero3_init: the plain copy of ZeRO-3 weights must not be partitioned again
        model = whole_model(
            model,
            ctx,
            lambda: build_model(cfg.model, len(tokenizer), eos_id=tokenizer.eos_token_id, pad_id=pad_id, seed=0),
        )
        if out is None:
            return StageResult(summary={"model_dir": str(output_dir), "rank": ctx.rank})

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
        save_model_dir(model.cpu(), tokenizer, out, history=history)
        write_manifest(out, "model", inputs=inputs, config=cfg.model_dump(mode="json"), metrics=metrics)
    logger.info("pretrain: val loss %.4f (perplexity %.1f) -> %s", val_loss, metrics["val_perplexity"], output_dir)

    html = page(
        "Pretraining",
        [*curves_section(history), ("Metrics", table(["metric", "value"], list(metrics.items())))],
        subtitle=f"{cfg.model.arch}, {cfg.model.n_layer} layers, {parameters / 1e6:.2f}M parameters",
    )
    return StageResult(metrics=metrics, html=html, summary={"model_dir": str(output_dir), **moved_summary})
