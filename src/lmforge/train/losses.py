"""Losses of the training stages, each a small function whose docstring states the math.

Logits are upcast to float32 before softmax so that bf16/fp16 autocast does not change the loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lmforge.train.batches import IGNORE_INDEX


def masked_ce(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean next-token cross-entropy over positions whose target is not ``ignore_index``.

    ``CE = (1/|M|) Σ_{i∈M} −log softmax(z_i)[y_i]`` with ``M`` the scored positions; 0 when ``M`` is empty.
    """
    flat = logits.float().reshape(-1, logits.size(-1))
    return F.cross_entropy(flat, targets.reshape(-1), ignore_index=ignore_index, reduction="sum") / (
        (targets != ignore_index).sum().clamp(min=1)
    )


def causal_lm_loss(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """Loop loss for a ``{"input_ids", "targets"}`` batch: (masked mean CE, number of scored tokens).

    No attention mask is passed: batches are right-padded and attention is causal, so no scored
    position can attend to padding.
    """
    logits = model(input_ids=batch["input_ids"], use_cache=False).logits
    targets = batch["targets"]
    return masked_ce(logits, targets), int((targets != IGNORE_INDEX).sum())


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float,
    alpha: float,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Knowledge-distillation loss (Hinton et al., 2015) over the positions where ``labels`` is scored.

    With student logits ``s``, teacher logits ``t``, temperature ``T`` and the set ``M`` of positions
    whose label is not ``ignore_index``::

        p_i = softmax(t_i / T)        q_i = softmax(s_i / T)
        KL  = (1/|M|) Σ_{i∈M} Σ_v p_i[v] · (log p_i[v] − log q_i[v])
        CE  = (1/|M|) Σ_{i∈M} −log softmax(s_i)[y_i]
        total = alpha · T² · KL + (1 − alpha) · CE

    The ``T²`` factor keeps the soft-target gradients on the same scale as the hard-target ones when
    ``T`` changes. Gradients flow to the student only (the teacher logits are detached).

    Args:
        student_logits, teacher_logits: ``(..., V)``.
        labels: ``(...)`` next-token ids aligned with the logits.

    Returns:
        ``(total, kl, ce)``; ``kl`` is the unscaled mean KL above.
    """
    mask = labels != ignore_index
    count = mask.sum().clamp(min=1)
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    kl_per_position = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    kl = kl_per_position.masked_fill(~mask, 0.0).sum() / count
    ce = masked_ce(student_logits, labels, ignore_index=ignore_index)
    total = alpha * temperature**2 * kl + (1.0 - alpha) * ce
    return total, kl, ce
