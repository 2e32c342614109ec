"""The ``finetune_lora`` stage: LoRA on prompt/response pairs, answer tokens only in the loss."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import peft
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lmforge.artifacts import input_record, staged_output, write_manifest
from lmforge.config import LoraConfig
from lmforge.data.qa import QAPair, load_pairs, split_pairs
from lmforge.errors import ConfigError
from lmforge.model.build import count_parameters, load_causal_lm, load_tokenizer, save_model_dir
from lmforge.report_html import page, table
from lmforge.results import StageResult
from lmforge.train.batches import IGNORE_INDEX, batch_generator
from lmforge.train.loop import curves_section, default_device, tokens_per_sec, train
from lmforge.train.losses import causal_lm_loss

logger = logging.getLogger("lmforge.finetune_lora")

DEFAULT_TARGETS: dict[str, list[str]] = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}

Encoded = tuple[list[int], list[int]]


def encode_pair(tokenizer: PreTrainedTokenizerBase, pair: QAPair, max_len: int) -> Encoded:
    """``(input_ids, labels)`` of prompt + response, truncated to ``max_len``; prompt labels are -100.

    Prompt and response are tokenized separately so that the boundary between them is exact.
    """
    prompt = tokenizer(pair.prompt_text())["input_ids"]
    response = tokenizer(pair.response_text(tokenizer.eos_token), add_special_tokens=False)["input_ids"]
    ids = (prompt + response)[:max_len]
    labels = ([IGNORE_INDEX] * len(prompt) + response)[:max_len]
    return ids, labels


def collate(examples: list[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example (labels -100 on padding) and shift into a loop batch."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    for row, (example_ids, example_labels) in enumerate(examples):
        ids[row, : len(example_ids)] = torch.tensor(example_ids)
        labels[row, : len(example_labels)] = torch.tensor(example_labels)
    return {"input_ids": ids[:, :-1], "targets": labels[:, 1:]}


def target_modules(model: PreTrainedModel, requested: list[str] | None) -> list[str]:
    """The modules to adapt: ``requested`` (each must exist) or the architecture's default."""
    arch = model.config.model_type
    if requested is None:
        if arch not in DEFAULT_TARGETS:
            raise ConfigError(f"finetune_lora.target_modules: no default for architecture {arch!r}; set it explicitly")
        return list(DEFAULT_TARGETS[arch])
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    for target in requested:
        if target not in names:
            raise ConfigError(
                f"finetune_lora.target_modules: {target!r} matches no module of the {arch} model "
                f"(default targets: {', '.join(DEFAULT_TARGETS.get(arch, []))})"
            )
    return list(requested)


def _pairs_record(uri: str, pairs: list[QAPair], heldout: list[QAPair]) -> dict[str, object]:
    content = json.dumps([[p.prompt, p.response] for p in pairs]).encode()
    return {
        "uri": str(uri),
        "kind": "qa_pairs",
        "fingerprint": hashlib.sha256(content).hexdigest(),
        "pairs": len(pairs),
        "heldout_pairs": len(heldout),
    }


def run(
    cfg: LoraConfig,
    base_model_dir: str | Path,
    qa_uri: str | Path,
    adapter_dir: str | Path,
    merged_dir: str | Path,
) -> StageResult:
    """LoRA-tune the base model on the Q&A pairs; write the PEFT adapter and the merged model.

    Held-out loss is the mean answer-token cross-entropy on the first ``eval_batches × batch_size``
    held-out pairs, measured before training (``base_heldout_loss``) and after (``tuned_heldout_loss``).
    """
    tcfg = cfg.train
    tokenizer = load_tokenizer(base_model_dir)
    model = load_causal_lm(base_model_dir)
    positions = model.config.max_position_embeddings
    if tcfg.seq_len > positions:
        raise ConfigError(
            f"finetune_lora.train.seq_len ({tcfg.seq_len}) exceeds the base model's {positions} positions"
        )
    targets = target_modules(model, cfg.target_modules)
    pairs = load_pairs(str(qa_uri))
    train_pairs, heldout_pairs = split_pairs(pairs, cfg.heldout_fraction)
    inputs = {
        "base_model": input_record(base_model_dir),
        "qa": _pairs_record(str(qa_uri), pairs, heldout_pairs),
    }

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_examples = [encode_pair(tokenizer, p, tcfg.seq_len) for p in train_pairs]
    heldout_examples = [encode_pair(tokenizer, p, tcfg.seq_len) for p in heldout_pairs]
    heldout_examples = heldout_examples[: tcfg.eval_batches * tcfg.batch_size]
    if all(label == IGNORE_INDEX for _, labels in heldout_examples for label in labels[1:]):
        raise ConfigError(f"finetune_lora.train.seq_len ({tcfg.seq_len}) cuts off every held-out answer; raise seq_len")
    heldout_batches = [
        collate(heldout_examples[i : i + tcfg.batch_size], pad_id)
        for i in range(0, len(heldout_examples), tcfg.batch_size)
    ]

    def train_batch(step: int, micro: int) -> dict[str, torch.Tensor]:
        generator = batch_generator(tcfg.seed, step, micro)
        rows = torch.randint(0, len(train_examples), (tcfg.batch_size,), generator=generator)
        return collate([train_examples[i] for i in rows.tolist()], pad_id)

    # Outputs are entered first so that an occupied output directory fails before training.
    with staged_output(adapter_dir) as adapter_out, staged_output(merged_dir) as merged_out:
        torch.manual_seed(tcfg.seed)  # LoRA A matrices are initialized randomly
        lora_config = peft.LoraConfig(
            r=cfg.r,
            lora_alpha=cfg.alpha,
            lora_dropout=cfg.dropout,
            target_modules=targets,
            fan_in_fan_out=model.config.model_type == "gpt2",  # GPT-2's Conv1D stores weights transposed
            task_type="CAUSAL_LM",
        )
        model = peft.get_peft_model(model, lora_config).to(default_device())
        trainable, total = count_parameters(model, trainable_only=True), count_parameters(model)
        logger.info(
            "LoRA r=%d on %s: %d of %d parameters trainable; %d train / %d held-out pairs",
            cfg.r,
            ",".join(targets),
            trainable,
            total,
            len(train_examples),
            len(heldout_pairs),
        )
        history = train(model, tcfg, causal_lm_loss, train_batch, lambda: heldout_batches, desc="finetune_lora")

        metrics = {
            "base_heldout_loss": history["eval_loss"][0],  # step 0: LoRA B is zero, so this is the base model
            "tuned_heldout_loss": history["eval_loss"][-1],
            "trainable_fraction": trainable / total,
            "tokens_per_sec": tokens_per_sec(history),
        }
        config = cfg.model_dump(mode="json") | {"resolved_target_modules": targets}
        model.save_pretrained(adapter_out)
        tokenizer.save_pretrained(adapter_out)
        write_manifest(adapter_out, "adapter", inputs=inputs, config=config, metrics=metrics)
        merged = model.merge_and_unload()
        save_model_dir(merged, tokenizer, merged_out, history=history)
        write_manifest(merged_out, "model", inputs=inputs, config=config, metrics=metrics)
    logger.info(
        "finetune_lora: held-out loss %.4f -> %.4f",
        metrics["base_heldout_loss"],
        metrics["tuned_heldout_loss"],
    )

    html = page(
        "LoRA fine-tuning",
        [
            *curves_section(history, title="Answer loss"),
            ("Metrics", table(["metric", "value"], list(metrics.items()))),
        ],
        subtitle=f"r={cfg.r}, alpha={cfg.alpha}, targets {', '.join(targets)}",
    )
    return StageResult(
        metrics=metrics, html=html, summary={"adapter_dir": str(adapter_dir), "merged_dir": str(merged_dir)}
    )
