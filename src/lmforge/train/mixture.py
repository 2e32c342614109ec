"""Task-aware distillation data: every micro-batch mixes corpus windows with fine-tuning examples.

Of a micro-batch's ``B = train.batch_size`` rows, the first ``B_c`` are corpus windows (the windows
:func:`~lmforge.train.batches.random_windows` draws for a ``B_c``-row batch) and the last ``B_q`` are
fine-tuning examples, ``B_q = round(qa_fraction·B)`` (at least 1 and at most ``B − 1`` when
``0 < qa_fraction < 1``). Examples come from the train split of the Q&A data, the split LoRA made
(:func:`lmforge.data.qa.split_examples` with the held-out fraction recorded in the teacher's manifest), so
no held-out example is ever trained on; they are encoded as LoRA encodes them
(:func:`lmforge.data.qa.encode_examples`: prompt tokens labelled ``-100``, long answers split along
sentences as LoRA was told to), drawn uniformly with replacement from ``(seed, step, slot)`` and
right-padded to the window width. So a batch, like the corpus windows alone, is a function of
``(seed, step, micro, rank)`` only, and resumption sees the data an uninterrupted run would.

The loss weighs the two parts by ``qa_fraction``, each a mean over its own scored tokens
(:meth:`Mixture.combine`)::

    loss = (1 − f)·L(corpus windows) + f·L(example responses)

so the short answers are not drowned by the many corpus tokens around them. With the KD objective the
teacher runs on the whole row (its logits on the prompt give the context) and is matched on the response
positions only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from lmforge.config import TrainConfig
from lmforge.contracts import QA_HELDOUT_FRACTION
from lmforge.data.qa import Encoded, Example, QALineage, encode_example, encode_examples, load_examples, split_examples
from lmforge.errors import ConfigError
from lmforge.formats.token_shards import TokenShards
from lmforge.train.batches import IGNORE_INDEX, collate, corpus_batches, val_batches

logger = logging.getLogger("lmforge.distill")

QA_STREAM = 1
"""Generator stream of the example draws (the corpus windows draw from stream 0)."""
EXACT_DRAWS = 100_000
"""Up to this many (step, slot) draws :func:`trained_on` replays them for exact example counts."""
PartLoss = Callable[[slice], tuple[torch.Tensor, Any]]


@dataclass(frozen=True)
class QARows:
    """Fine-tuning examples encoded for distillation, split into train and held-out as LoRA split them."""

    uri: str
    heldout_fraction: float
    fraction_source: str
    train_examples: list[Example]
    heldout_examples: list[Example]
    train: list[Encoded]
    heldout: list[Encoded]
    split_examples: int
    dropped_rows: int


def load_qa_rows(
    uri: str, tokenizer: PreTrainedTokenizerBase, lineage: QALineage, *, width: int, heldout_limit: int
) -> QARows:
    """Read, split and encode the Q&A data at ``uri`` into rows of at most ``width`` tokens.

    The held-out fraction, chat template and long-example splitting are the fine-tuning stage's
    (``lineage``, from the teacher's manifest); without a recorded fraction, LoRA's default.
    ``heldout_limit``: held-out examples encoded (for the held-out answer loss). A row whose prompt leaves no
    answer token within ``width`` would score nothing; such rows are dropped (and counted).
    """
    if lineage.heldout_fraction is not None:
        fraction, source = lineage.heldout_fraction, "the LoRA stage's manifest"
    else:
        fraction, source = QA_HELDOUT_FRACTION, "the finetune_lora default"
        logger.warning("the teacher's manifest records no Q&A held-out fraction; using %g (%s)", fraction, source)
    examples = load_examples(uri)
    train, heldout = split_examples(examples, fraction)
    split_lang = lineage.split_lang if lineage.split_long_examples else None
    rows, split = encode_examples(tokenizer, train, width, chat_template=lineage.chat_template, split_lang=split_lang)
    held = [encode_example(tokenizer, e, width, chat_template=lineage.chat_template) for e in heldout[:heldout_limit]]
    kept, kept_heldout = _scoring(rows), _scoring(held)
    dropped = len(rows) - len(kept) + len(held) - len(kept_heldout)
    if dropped:
        logger.warning("%d Q&A rows leave no answer token within %d tokens and are not used", dropped, width)
    return QARows(uri, fraction, source, train, heldout, kept, kept_heldout, split, dropped)


def _scoring(rows: list[Encoded]) -> list[Encoded]:
    """The rows with at least one scored target (a label after the first position)."""
    return [(ids, labels) for ids, labels in rows if any(label != IGNORE_INDEX for label in labels[1:])]


@dataclass(frozen=True)
class Mixture:
    """How each micro-batch is made: ``corpus_rows`` windows, then ``qa_rows`` examples, and the loss weight."""

    qa_fraction: float
    corpus_rows: int
    qa_rows: int
    reason: str | None = field(default=None, compare=False)

    def combine(self, part: PartLoss, corpus_rows: int) -> tuple[torch.Tensor, Any]:
        """``(1 − f)·part(windows) + f·part(examples)`` and the scored tokens of both; one part alone when the
        batch holds only one kind of row. ``part(rows)`` returns ``(mean loss, scored tokens)`` of those rows."""
        if self.qa_rows == 0 or corpus_rows == 0:
            return part(slice(None))
        corpus_loss, corpus_tokens = part(slice(0, corpus_rows))
        qa_loss, qa_tokens = part(slice(corpus_rows, None))
        return (1.0 - self.qa_fraction) * corpus_loss + self.qa_fraction * qa_loss, corpus_tokens + qa_tokens


def plan_mixture(qa_fraction: float, batch_size: int, qa: QARows | None) -> Mixture:
    """The rows of each kind per micro-batch for ``qa_fraction`` of ``batch_size`` (corpus only without examples).

    Raises:
        ConfigError: a mixture (``0 < qa_fraction < 1``) with ``batch_size`` 1, which cannot hold both kinds.
    """
    if qa is None or qa_fraction == 0.0:
        reason = "no Q&A data given or recorded in the teacher's manifest" if qa is None else "qa_fraction is 0"
        return Mixture(0.0, batch_size, 0, reason if qa_fraction > 0 else None)
    if qa_fraction == 1.0:
        return Mixture(1.0, 0, batch_size)
    if batch_size < 2:
        raise ConfigError(
            f"distill.qa_fraction {qa_fraction} mixes corpus windows and examples in every micro-batch, which needs "
            "train.batch_size >= 2 (or qa_fraction 0 or 1)"
        )
    qa_rows = min(max(round(qa_fraction * batch_size), 1), batch_size - 1)
    return Mixture(qa_fraction, batch_size - qa_rows, qa_rows)


def _example_draw(seed: int, step: int, slot: int, count: int, population: int) -> list[int]:
    state = np.random.SeedSequence([seed, step, slot, QA_STREAM]).generate_state(1, dtype=np.uint64)[0]
    generator = torch.Generator().manual_seed(int(state))
    return torch.randint(0, population, (count,), generator=generator).tolist()


def mixture_batches(
    shards: TokenShards,
    cfg: TrainConfig,
    mixture: Mixture,
    qa: QARows | None,
    pad_id: int,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[Callable[[int, int], dict[str, Any]], list[dict[str, torch.Tensor]]]:
    """``(train_batch(step, micro), corpus validation batches)``; a training batch is ``{"input_ids",
    "targets", "corpus_rows"}`` with the corpus windows first (see the module docstring)."""
    train_tokens = shards.tokens("train")
    val = val_batches(shards, cfg)
    if mixture.qa_rows and (qa is None or not qa.train):
        raise ConfigError("distill: the mixture asks for fine-tuning examples but there are none to train on")
    corpus = corpus_batches(train_tokens, cfg, rows=mixture.corpus_rows, rank=rank, world_size=world_size)

    def train_batch(step: int, micro: int) -> dict[str, Any]:
        parts = []
        if mixture.corpus_rows:
            parts.append(corpus(step, micro))
        if mixture.qa_rows and qa is not None:
            slot = micro * world_size + rank
            picked = _example_draw(cfg.seed, step, slot, mixture.qa_rows, len(qa.train))
            width = cfg.seq_len + 1 if mixture.corpus_rows else None
            parts.append(collate([qa.train[i] for i in picked], pad_id, width=width))
        return {
            "input_ids": torch.cat([p["input_ids"] for p in parts]),
            "targets": torch.cat([p["targets"] for p in parts]),
            "corpus_rows": mixture.corpus_rows,
        }

    return train_batch, val


def heldout_batches(qa: QARows, pad_id: int, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """The encoded held-out examples in batches (padded to the longest of each), for the answer loss."""
    return [collate(qa.heldout[i : i + batch_size], pad_id) for i in range(0, len(qa.heldout), batch_size)]


def trained_on(mixture: Mixture, qa: QARows | None, cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    """What the whole run trains on: windows and corpus tokens, example rows, their response and prompt tokens.

    The example counts replay the draws of every step and slot (they depend on nothing else), so they are
    exact whatever the run's resumptions; above :data:`EXACT_DRAWS` draws (a long multi-node run) they are the
    expected counts instead (``"example_counts": "expected"``), which cost nothing to compute.
    """
    slots = cfg.grad_accum * world_size
    record: dict[str, Any] = {
        "corpus_windows": cfg.max_steps * slots * mixture.corpus_rows,
        "corpus_tokens": cfg.max_steps * slots * mixture.corpus_rows * cfg.seq_len,
        "example_rows": cfg.max_steps * slots * mixture.qa_rows,
        "response_tokens": 0,
        "prompt_tokens": 0,
    }
    if mixture.qa_rows and qa is not None:
        scored = np.array([sum(label != IGNORE_INDEX for label in labels[1:]) for _, labels in qa.train])
        lengths = np.array([len(ids) - 1 for ids, _ in qa.train])
        if cfg.max_steps * slots <= EXACT_DRAWS:
            drawn = np.zeros(len(qa.train), dtype=np.int64)
            for step in range(cfg.max_steps):
                for slot in range(slots):
                    np.add.at(drawn, _example_draw(cfg.seed, step, slot, mixture.qa_rows, len(qa.train)), 1)
            record["example_counts"] = "exact"
            record["distinct_examples_drawn"] = int((drawn > 0).sum())
        else:
            drawn = np.full(len(qa.train), record["example_rows"] / len(qa.train))
            record["example_counts"] = "expected"
        record["response_tokens"] = round(float(drawn @ scored))
        record["prompt_tokens"] = round(float(drawn @ (lengths - scored)))
    return record
