"""The ``pretrain`` stage: a freshly initialized causal LM trained on token shards."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from lmforge.artifacts import input_record, staged_output, write_manifest
from lmforge.config import PretrainConfig
from lmforge.model.build import build_model, count_parameters, load_tokenizer, save_model_dir
from lmforge.report_html import page, table
from lmforge.results import StageResult
from lmforge.train.batches import open_matching_shards, shard_batches
from lmforge.train.loop import curves_section, default_device, tokens_per_sec, train
from lmforge.train.losses import causal_lm_loss

logger = logging.getLogger("lmforge.pretrain")


def run(cfg: PretrainConfig, shards_dir: str | Path, tokenizer_dir: str | Path, output_dir: str | Path) -> StageResult:
    """Pretrain ``cfg.model`` on the shards' train split; write an HF model directory to ``output_dir``.

    Raises:
        InputDataError: the shards were not written by the tokenizer in ``tokenizer_dir``, or a split
            is shorter than one training window.
    """
    shards = open_matching_shards(shards_dir, tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    inputs = {"shards": input_record(shards_dir), "tokenizer": input_record(tokenizer_dir)}
    train_batch, val_batches = shard_batches(shards, cfg.train)

    with staged_output(output_dir) as out:  # entered first: an occupied output fails before training
        model = build_model(
            cfg.model,
            len(tokenizer),
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            seed=cfg.train.seed,
        ).to(default_device())
        parameters = count_parameters(model)
        logger.info(
            "pretraining %s (%d layers, %.2fM parameters) for %d steps on %d train tokens",
            cfg.model.arch,
            cfg.model.n_layer,
            parameters / 1e6,
            cfg.train.max_steps,
            shards.index["splits"]["train"]["tokens"],
        )
        history = train(model, cfg.train, causal_lm_loss, train_batch, lambda: val_batches, desc="pretrain")

        val_loss = history["eval_loss"][-1]
        metrics = {
            "train_loss": history["train_loss"][-1],
            "val_loss": val_loss,
            "val_perplexity": math.exp(val_loss),
            "tokens_per_sec": tokens_per_sec(history),
            "parameters": float(parameters),
            "steps": float(cfg.train.max_steps),
        }
        save_model_dir(model, tokenizer, out, history=history)
        write_manifest(out, "model", inputs=inputs, config=cfg.model_dump(mode="json"), metrics=metrics)
    logger.info("pretrain: val loss %.4f (perplexity %.1f) -> %s", val_loss, metrics["val_perplexity"], output_dir)

    html = page(
        "Pretraining",
        [*curves_section(history), ("Metrics", table(["metric", "value"], list(metrics.items())))],
        subtitle=f"{cfg.model.arch}, {cfg.model.n_layer} layers, {parameters / 1e6:.2f}M parameters",
    )
    return StageResult(metrics=metrics, html=html, summary={"model_dir": str(output_dir)})
