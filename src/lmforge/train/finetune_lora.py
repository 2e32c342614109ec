"""The ``finetune_lora`` stage: LoRA on prompt/response or chat data, answer tokens only in the loss.

The base model may be a local directory or an ``s3://`` prefix in Hugging Face layout (any causal LM
``transformers`` can build offline). The stage writes the PEFT adapter and the merged standalone model;
the adapter applied to the base and the merged model compute the same logits (to fp32 rounding).
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import peft
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from lmforge import storage
from lmforge.artifacts import write_manifest
from lmforge.config import LoraConfig, TrainConfig
from lmforge.data.qa import Example, encode_example, encode_examples, load_examples, split_examples
from lmforge.data.tokenizer import save_tokenizer
from lmforge.errors import ConfigError, InputDataError
from lmforge.model.base import base_tokenizer, localize_model, model_record
from lmforge.model.build import count_parameters, load_causal_lm, save_model_dir
from lmforge.model.lora import peft_config, target_modules
from lmforge.report_html import page, table
from lmforge.results import StageResult
from lmforge.train.batches import IGNORE_INDEX, batch_generator, collate
from lmforge.train.distributed import (
    DistContext,
    describe_backend,
    distributed_context,
    main_rank_outputs,
    refuse_occupied,
)
from lmforge.train.loop import curves_section, quarantine_facts, scale_metrics, tokens_per_sec, train, whole_model
from lmforge.train.losses import causal_lm_loss
from lmforge.train.mfu import lora_model_flops_per_token

logger = logging.getLogger("lmforge.finetune_lora")

Encoded = tuple[list[int], list[int]]


def pack(examples: list[Encoded], width: int, *, seed: int) -> list[Encoded]:
    """Concatenate the examples (in a seeded shuffled order) and cut the stream into rows of ``width`` tokens.

    Every example ends in EOS, so the model sees where one stops; the tail shorter than a row is dropped
    (it is at most one row's worth of tokens, from a shuffled order).
    """
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    ids = [t for i in order for t in examples[i][0]]
    labels = [t for i in order for t in examples[i][1]]
    rows = [(ids[s : s + width], labels[s : s + width]) for s in range(0, len(ids) - width + 1, width)]
    if not rows:
        raise ConfigError(f"finetune_lora.packing: the training data holds fewer than one row of {width} tokens")
    return rows


def check_backend(tcfg: TrainConfig) -> None:
    """Refuse ZeRO-3, which partitions the base weights that saving and merging the adapter read whole, and tensor
    parallelism, whose plan splits plain Linear layers, not the LoRA-wrapped ones."""
    if tcfg.distributed.backend == "fsdp2" and tcfg.distributed.mesh.tensor_parallel > 1:
        raise ConfigError(
            f"finetune_lora.train.distributed.mesh.tensor_parallel ({tcfg.distributed.mesh.tensor_parallel}): LoRA "
            "does not split the adapted layers over tensor-parallel ranks; use tensor_parallel: 1 (data_parallel_shard "
            "alone shards the base)"
        )
    if tcfg.distributed.backend == "deepspeed" and tcfg.distributed.deepspeed.zero.stage == 3:
        raise ConfigError(
            "finetune_lora.train.distributed.deepspeed.zero.stage: stage 3 partitions the base model's weights, "
            "but saving the PEFT adapter and merging it need them whole; use stage 1 or 2 (they shard the "
            "adapter's optimizer state and gradients; the frozen base has neither), backend torch (DDP) or fsdp2"
        )


def _examples_record(uri: str, examples: list[Example], heldout: list[Example]) -> dict[str, object]:
    content = json.dumps([repr(e) for e in examples]).encode()
    return {
        "uri": str(uri),
        "kind": "qa_examples",
        "fingerprint": hashlib.sha256(content).hexdigest(),
        "examples": len(examples),
        "heldout_examples": len(heldout),
    }


def load_base(base_uri: str | Path, workdir: str | Path) -> tuple[Path, PreTrainedTokenizerBase, PreTrainedModel]:
    """Localize a base model (directory or ``s3://`` prefix) and load its tokenizer and weights (fp32, eval)."""
    local = localize_model(base_uri, workdir)
    return local, base_tokenizer(local), load_causal_lm(local)


def load_adapted(base_uri: str | Path, adapter_uri: str | Path, workdir: str | Path) -> peft.PeftModel:
    """The base model with a PEFT adapter applied, each from a local directory or ``s3://`` prefix (eval mode)."""
    _, _, base = load_base(base_uri, Path(workdir, "base"))
    adapter = storage.localize(str(adapter_uri), Path(workdir, "adapter"))
    if not (adapter / "adapter_config.json").is_file():
        raise InputDataError(f"adapter {adapter_uri}: no adapter_config.json (expected a PEFT adapter directory)")
    return peft.PeftModel.from_pretrained(base, adapter).eval()


def run(
    cfg: LoraConfig,
    *,
    base_model: str | Path,
    qa_uri: str | Path,
    adapter: str | Path,
    merged_model: str | Path,
) -> StageResult:
    """LoRA-tune the base model on the Q&A/chat examples; write the PEFT adapter and the merged model.

    Held-out loss is the mean answer-token cross-entropy on the first ``eval_batches × batch_size``
    held-out examples, measured before training (``base_heldout_loss``, LoRA's B is zero at step 0) and
    after (``tuned_heldout_loss``).

    Runs as one process, or on every rank of a ``torchrun`` / Kubeflow Trainer job (DDP, DeepSpeed ZeRO-1/2 or
    FSDP2 without tensor parallelism): each rank trains on its own part of every step's batch and rank 0 writes
    the outputs (FSDP2's shards gathered first).

    Raises:
        InputDataError: the base model has no weights or tokenizer, the data is empty or malformed, or an
            output directory is not empty.
        ConfigError: a target module does not exist or cannot take LoRA, seq_len does not fit, ZeRO stage 3, or
            FSDP2 with tensor_parallel > 1.
    """
    check_backend(cfg.train)
    refuse_occupied(adapter, merged_model)  # on every rank, before any of them trains
    with tempfile.TemporaryDirectory(prefix="lmforge-lora-") as workdir:
        local_base, tokenizer, model = load_base(base_model, workdir)
        base_record = model_record(local_base, str(base_model))
        return _run(cfg, model, tokenizer, base_record, str(base_model), qa_uri, adapter, merged_model)


def _train_rows(
    cfg: LoraConfig, tokenizer: PreTrainedTokenizerBase, examples: list[Example]
) -> tuple[list[Encoded], int]:
    """The encoded training rows (packed when configured) and how many long examples were split."""
    split_lang = cfg.split_lang if cfg.split_long_examples else None
    rows, split_count = encode_examples(
        tokenizer, examples, cfg.train.seq_len + 1, chat_template=cfg.chat_template, split_lang=split_lang
    )
    if cfg.packing:
        rows = pack(rows, cfg.train.seq_len + 1, seed=cfg.train.seed)
    return rows, split_count


def _heldout_batches(
    cfg: LoraConfig, tokenizer: PreTrainedTokenizerBase, examples: list[Example], pad_id: int
) -> list[dict[str, torch.Tensor]]:
    """The first ``eval_batches × batch_size`` held-out examples in batches; refused when no answer token fits."""
    tcfg = cfg.train
    width = tcfg.seq_len + 1  # inputs and shifted targets are seq_len long
    rows = [
        encode_example(tokenizer, e, width, chat_template=cfg.chat_template)
        for e in examples[: tcfg.eval_batches * tcfg.batch_size]
    ]
    if all(label == IGNORE_INDEX for _, labels in rows for label in labels[1:]):
        raise ConfigError(f"finetune_lora.train.seq_len ({tcfg.seq_len}) cuts off every held-out answer; raise seq_len")
    return [collate(rows[i : i + tcfg.batch_size], pad_id) for i in range(0, len(rows), tcfg.batch_size)]


def _batch_sampler(
    rows: list[Encoded], tcfg: TrainConfig, pad_id: int, ctx: DistContext
) -> Callable[[int, int], dict[str, torch.Tensor]]:
    """``(step, micro) -> batch`` of this rank, drawn with replacement from ``rows``."""

    def train_batch(step: int, micro: int) -> dict[str, torch.Tensor]:
        # The step's micro-batches are slots 0 .. grad_accum·world_size - 1, each drawn from (seed, step,
        # slot); this rank's micro-batch `micro` is slot micro·world_size + rank. One rank: slot = micro, and
        # 2 ranks see the micro-batches one process with twice the grad_accum sees.
        generator = batch_generator(tcfg.seed, step, micro * ctx.world_size + ctx.rank)
        picks = torch.randint(0, len(rows), (tcfg.batch_size,), generator=generator)
        return collate([rows[i] for i in picks.tolist()], pad_id)

    return train_batch


def _adapted(
    model: PreTrainedModel, lora_config: peft.LoraConfig, base_uri: str, seed: int, device: torch.device
) -> peft.PeftModel:
    """``model`` wrapped with a fresh LoRA adapter on ``device``."""
    torch.manual_seed(seed)  # LoRA A matrices are initialized randomly (the same on every rank)
    adapted = peft.get_peft_model(model, lora_config).to(device)
    # Lineage: the adapter names the URI the base came from, not this run's scratch copy.
    adapted.peft_config["default"].base_model_name_or_path = base_uri
    return adapted


def _whole_adapted(
    model: peft.PeftModel, lora_config: peft.LoraConfig, base_uri: str, ctx: DistContext
) -> peft.PeftModel | None:
    """The trained adapted model with all of its weights on rank 0 (None elsewhere); called on every rank.

    An FSDP2-sharded model's base and adapter shards are gathered into a fresh adapted copy on the CPU, which peft
    saves and merges as it does an unsharded one.
    """
    config = model.config

    def build() -> peft.PeftModel:
        # Every weight is overwritten by the gathered state, so the LoRA init seed does not matter.
        return _adapted(AutoModelForCausalLM.from_config(config).float(), lora_config, base_uri, 0, torch.device("cpu"))

    return whole_model(model, ctx, build)


def _log_plan(
    cfg: LoraConfig, targets: list[str], parameters: tuple[int, int], rows: int, heldout: int, world_size: int
) -> None:
    """Log the adapter's shape and the data; ``parameters`` is (trainable, total)."""
    logger.info(
        "LoRA r=%d alpha=%d (scaling %.3g%s) on %s: %d of %d parameters trainable; %d train rows%s, "
        "%d held-out examples; %d rank(s), %s",
        cfg.r,
        cfg.alpha,
        cfg.scaling,
        ", rsLoRA" if cfg.use_rslora else "",
        ",".join(targets),
        *parameters,
        rows,
        " (packed)" if cfg.packing else "",
        heldout,
        world_size,
        describe_backend(cfg.train.distributed),
    )


def _metrics(history: dict[str, Any], parameters: tuple[int, int], split_count: int) -> dict[str, float]:
    """The stage's metrics; ``parameters`` is (trainable, total)."""
    base_loss, tuned_loss = history["eval_loss"][0], history["eval_loss"][-1]
    metrics = {
        "base_heldout_loss": base_loss,
        "tuned_heldout_loss": tuned_loss,
        "heldout_loss_reduction": 1.0 - tuned_loss / base_loss,
        "train_loss": history["train_loss"][-1],
        "trainable_fraction": parameters[0] / parameters[1],
        "tokens_per_sec": tokens_per_sec(history),
        "split_examples": split_count,
    }
    return metrics | quarantine_facts(history)[0]


def _save(
    model: peft.PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    outputs: tuple[Path, Path],
    history: dict[str, Any],
    manifest: dict[str, Any],
) -> None:
    """Write the adapter and the merged model to ``outputs`` (adapter, merged), each with ``manifest``'s fields."""
    adapter_out, merged_out = outputs
    model.save_pretrained(adapter_out)
    save_tokenizer(tokenizer, adapter_out)
    write_manifest(adapter_out, "adapter", **manifest)
    merged = model.merge_and_unload()
    save_model_dir(merged, tokenizer, merged_out, history=history)
    write_manifest(merged_out, "model", **manifest)


def _report(cfg: LoraConfig, history: dict[str, Any], metrics: dict[str, float], targets: list[str]) -> str:
    return page(
        "LoRA fine-tuning",
        [
            *curves_section(history, title="Answer loss"),
            ("Metrics", table(["metric", "value"], list(metrics.items()))),
        ],
        subtitle=f"r={cfg.r}, alpha={cfg.alpha} (scaling {cfg.scaling:.3g}), targets {', '.join(targets)}",
    )


def _run(
    cfg: LoraConfig,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    base_record: dict[str, object],
    base_uri: str,
    qa_uri: str | Path,
    adapter_dir: str | Path,
    merged_dir: str | Path,
) -> StageResult:
    tcfg = cfg.train
    positions = model.config.max_position_embeddings
    if tcfg.seq_len > positions:
        raise ConfigError(
            f"finetune_lora.train.seq_len ({tcfg.seq_len}) exceeds the base model's {positions} positions"
        )
    targets = target_modules(model, cfg.target_modules)
    lora_config = peft_config(cfg, model, targets)
    examples = load_examples(str(qa_uri))
    train_examples, heldout_examples = split_examples(examples, cfg.heldout_fraction)
    inputs = {"base_model": base_record, "qa": _examples_record(str(qa_uri), examples, heldout_examples)}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_rows, split_count = _train_rows(cfg, tokenizer, train_examples)
    heldout_batches = _heldout_batches(cfg, tokenizer, heldout_examples, pad_id)

    with distributed_context(tcfg.distributed) as ctx, main_rank_outputs(ctx, adapter_dir, merged_dir) as outputs:
        train_batch = _batch_sampler(train_rows, tcfg, pad_id, ctx)
        model = _adapted(model, lora_config, base_uri, tcfg.seed, ctx.device)
        parameters = count_parameters(model, trainable_only=True), count_parameters(model)
        if ctx.is_main:
            _log_plan(cfg, targets, parameters, len(train_rows), len(heldout_examples), ctx.world_size)
        history = train(
            model, tcfg, causal_lm_loss, train_batch, lambda: heldout_batches, desc="finetune_lora", dist=ctx,
            flops_per_token=lora_model_flops_per_token(model, tcfg.seq_len),
        )  # fmt: skip
        whole = _whole_adapted(model, lora_config, base_uri, ctx)
        adapter_out, merged_out = outputs
        if whole is None or adapter_out is None or merged_out is None:
            return StageResult(
                summary={"adapter_dir": str(adapter_dir), "merged_dir": str(merged_dir), "rank": ctx.rank}
            )

        metrics = _metrics(history, parameters, split_count) | scale_metrics(history, ctx.world_size)
        config = cfg.model_dump(mode="json") | {"resolved_target_modules": targets, "scaling": cfg.scaling}
        manifest = {"inputs": inputs, "config": config, "metrics": metrics}
        _save(whole, tokenizer, (adapter_out, merged_out), history, manifest)
    logger.info(
        "finetune_lora: held-out answer loss %.4f -> %.4f", metrics["base_heldout_loss"], metrics["tuned_heldout_loss"]
    )
    return StageResult(
        metrics=metrics,
        html=_report(cfg, history, metrics, targets),
        summary={"adapter_dir": str(adapter_dir), "merged_dir": str(merged_dir), **quarantine_facts(history)[1]},
    )
