"""Held-out answer loss: how well a model predicts the reference answers of the held-out Q&A examples.

Each example is encoded as fine-tuning encodes it (:func:`lmforge.data.qa.encode_example`: the prompt
template, the answer and EOS; prompt tokens unscored), truncated to ``context + 1`` tokens, and fed
without a KV cache through a :data:`~lmforge.metrics.perplexity.LogitsFn`, so PyTorch and ONNX models
are scored by the same code. The figure is the token-weighted mean cross-entropy over the answer tokens
(in nats), summed in float64::

    answer_loss = Σ_examples Σ_{answer positions} −log softmax(logits)[target] / answer tokens

It is LoRA's held-out loss on the same split, but over every held-out example rather than the first
batches, so the teacher's figure here and the student's are comparable with each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lmforge.metrics.perplexity import LogitsFn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from lmforge.data.qa import Example

IGNORE_INDEX = -100


@dataclass(frozen=True)
class AnswerLoss:
    """Summed answer-token NLL and its mean."""

    nll_sum: float
    tokens: int
    examples: int

    @property
    def mean(self) -> float:
        """Mean NLL per answer token (nats)."""
        return self.nll_sum / self.tokens

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping (for JSON), with ``mean``."""
        return {**asdict(self), "mean": self.mean}


def encode_heldout(
    tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], *, context: int, chat_template: str
) -> list[tuple[list[int], list[int]]]:
    """``(ids, labels)`` of each example, at most ``context + 1`` tokens; examples with no answer token left are
    dropped (their prompt alone fills the context)."""
    from lmforge.data.qa import encode_example

    rows = [encode_example(tokenizer, e, context + 1, chat_template=chat_template) for e in examples]
    return [(ids, labels) for ids, labels in rows if any(label != IGNORE_INDEX for label in labels[1:])]


def answer_loss(
    logits_fn: LogitsFn, rows: Sequence[tuple[list[int], list[int]]], *, pad_id: int, batch_size: int = 8
) -> AnswerLoss:
    """Mean cross-entropy over the answer tokens of ``rows`` (see the module docstring)."""
    if not rows:
        raise ValueError("no held-out example has an answer token within the context")
    nll, tokens = 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        width = max(len(ids) for ids, _ in batch)
        ids = np.full((len(batch), width), pad_id, dtype=np.int64)
        labels = np.full((len(batch), width), IGNORE_INDEX, dtype=np.int64)
        for i, (row_ids, row_labels) in enumerate(batch):
            ids[i, : len(row_ids)], labels[i, : len(row_labels)] = row_ids, row_labels
        logits = torch.as_tensor(logits_fn(ids[:, :-1])).float()
        targets = torch.from_numpy(labels[:, 1:])
        losses = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
        )
        nll += float(losses.double().sum())
        tokens += int((targets != IGNORE_INDEX).sum())
    return AnswerLoss(nll_sum=nll, tokens=tokens, examples=len(rows))
