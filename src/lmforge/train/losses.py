"""Losses of the training stages, each small, with its math in the docstring.

Logits are upcast to float32 before softmax so that bf16/fp16 autocast does not change the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from lmforge.train.batches import IGNORE_INDEX

Divergence = Literal["forward", "reverse"]


def masked_ce(
    logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = IGNORE_INDEX, fused: bool = True
) -> torch.Tensor:
    """Mean next-token cross-entropy over positions whose target is not ``ignore_index``.

    ``CE = (1/|M|) Σ_{i∈M} −log softmax(z_i)[y_i]`` with ``M`` the scored positions; 0 when ``M`` is empty.
    ``fused`` computes the gradient in closed form (:class:`_MaskedCrossEntropy`); off, autograd through
    ``F.cross_entropy``. The two agree to float rounding.
    """
    flat = logits.float().reshape(-1, logits.size(-1))
    if fused and flat.requires_grad:
        return _MaskedCrossEntropy.apply(flat, targets.reshape(-1), ignore_index)
    return F.cross_entropy(flat, targets.reshape(-1), ignore_index=ignore_index, reduction="sum") / (
        (targets != ignore_index).sum().clamp(min=1)
    )


class _MaskedCrossEntropy(torch.autograd.Function):
    """Masked mean cross-entropy with the closed-form gradient ``(softmax(z_i) − onehot(y_i)) / |M|``.

    Autograd's path keeps the log-probabilities, then allocates and zero-fills a ``(N, V)`` gradient for
    ``nll_loss`` and another for ``log_softmax``'s backward. Here the saved log-probabilities become the
    gradient in place: one ``exp_`` and one scaling pass, no ``(N, V)`` allocation in the backward pass.
    Because the saved tensor is consumed, a second backward through the same graph is refused.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        log_probs = torch.log_softmax(logits, dim=-1)
        scored = targets != ignore_index
        count = scored.sum().clamp(min=1)
        safe = torch.where(scored, targets, 0)
        picked = log_probs.gather(1, safe[:, None]).squeeze(1)
        ctx.save_for_backward(log_probs, safe, scored, count)
        ctx.consumed = False
        return -(picked * scored).sum() / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.consumed:
            raise RuntimeError("masked_ce (fused): backward ran twice through the same graph; use fused=False")
        ctx.consumed = True
        log_probs, safe, scored, count = ctx.saved_tensors
        gradient = log_probs.exp_()  # softmax, in the saved buffer
        rows = torch.arange(len(safe), device=safe.device)
        gradient[rows, safe] -= 1.0
        gradient.mul_((grad / count * scored)[:, None])
        return gradient, None, None


def causal_lm_loss(
    model: torch.nn.Module, batch: dict[str, Any], *, fused_ce: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop loss for a ``{"input_ids", "targets"}`` batch: (masked mean CE, number of scored tokens).

    The count stays a tensor on the batch's device, so that the loop reads it back only when it logs.

    No attention mask is passed: batches are right-padded and attention is causal, so no scored
    position can attend to padding.
    """
    logits = model(input_ids=batch["input_ids"], use_cache=False).logits
    targets = batch["targets"]
    return masked_ce(logits, targets, fused=fused_ce), (targets != IGNORE_INDEX).sum()


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float,
    alpha: float,
    divergence: Divergence = "forward",
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Knowledge-distillation loss (Hinton et al., 2015) over the positions where ``labels`` is scored.

    The reference implementation: plain autograd over the full ``(..., V)`` tensors. :class:`ChunkedKDLoss`
    computes the same values with far less memory traffic and is what training uses.

    With student logits ``s``, teacher logits ``t``, temperature ``T`` and the set ``M`` of positions
    whose label is not ``ignore_index``::

        p_i = softmax(t_i / T)        q_i = softmax(s_i / T)
        KL  = (1/|M|) Σ_{i∈M} Σ_v p_i[v] · (log p_i[v] − log q_i[v])     (forward: KL(p ‖ q))
        KL  = (1/|M|) Σ_{i∈M} Σ_v q_i[v] · (log q_i[v] − log p_i[v])     (reverse: KL(q ‖ p))
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
    if divergence == "forward":
        kl_per_position = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    else:
        kl_per_position = (log_q.exp() * (log_q - log_p)).sum(dim=-1)
    kl = kl_per_position.masked_fill(~mask, 0.0).sum() / count
    ce = masked_ce(student_logits, labels, ignore_index=ignore_index)
    total = alpha * temperature**2 * kl + (1.0 - alpha) * ce
    return total, kl, ce


@dataclass(frozen=True)
class KDTerms:
    """The KD objective of one batch: ``total`` (differentiable), its unscaled ``kl`` and ``ce`` parts
    (diagnostics, not differentiable) and the number of scored positions."""

    total: torch.Tensor
    kl: torch.Tensor
    ce: torch.Tensor
    n_tokens: int


def _kd_chunk(
    s: torch.Tensor,
    t: torch.Tensor,
    y: torch.Tensor,
    row_scale: torch.Tensor,
    temperature: float,
    alpha: float,
    reverse: bool,
    work: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    grad_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL and CE of one chunk; writes d(α·T²·KL + (1−α)·CE)/ds · row_scale into ``grad_out``.

    Works in place in three preallocated ``(chunk, V)`` buffers (at least fp32) so that no full-vocabulary
    tensor is allocated per chunk. ``row_scale`` is ``1/|M|`` on scored rows and 0 elsewhere.
    """
    n = s.shape[0]
    a, b, c = (w[:n] for w in work)
    torch.mul(s, 1.0 / temperature, out=a)
    a.sub_(torch.logsumexp(a, dim=-1, keepdim=True))  # log q
    torch.mul(t, 1.0 / temperature, out=b)
    b.sub_(torch.logsumexp(b, dim=-1, keepdim=True))  # log p
    if reverse:
        torch.sub(a, b, out=c)  # log q − log p
        a.exp_()  # q
        kl_rows = torch.bmm(a.unsqueeze(1), c.unsqueeze(2)).view(n)
        if grad_out is not None:  # α·T·q ⊙ (log q − log p − KL)
            c.sub_(kl_rows.unsqueeze(-1)).mul_(a).mul_(alpha * temperature)
            grad_kl = c
    else:
        torch.sub(b, a, out=c)  # log p − log q
        b.exp_()  # p
        kl_rows = torch.bmm(b.unsqueeze(1), c.unsqueeze(2)).view(n)
        if grad_out is not None:  # α·T·(q − p)
            grad_kl = a.exp_().sub_(b).mul_(alpha * temperature)
    # CE = logsumexp(s) − s[y], in fp32 in the free buffer (b, or c in the reverse case where c holds the gradient).
    r = c if not reverse or grad_out is None else b
    r.copy_(s)
    lse = torch.logsumexp(r, dim=-1, keepdim=True)
    safe_y = y.clamp(min=0).unsqueeze(-1)
    ce_rows = (lse - r.gather(-1, safe_y)).view(n)
    if grad_out is not None:  # (1−α)·(softmax(s) − onehot(y)), then the α·T² KL part, all times row_scale
        r.sub_(lse).exp_()
        r.scatter_add_(-1, safe_y, torch.full_like(safe_y, -1, dtype=r.dtype))
        grad_kl.add_(r, alpha=1.0 - alpha).mul_(row_scale.unsqueeze(-1))
        grad_out.copy_(grad_kl)
    return kl_rows, ce_rows


class _ChunkedKD(torch.autograd.Function):
    """Forward computes the loss and its gradient chunk by chunk; backward only scales the saved gradient."""

    @staticmethod
    def forward(ctx, student, teacher, labels, temperature, alpha, reverse, chunk, ignore_index):  # type: ignore[override]
        mask = labels != ignore_index
        count = mask.sum().clamp(min=1)
        acc = torch.promote_types(student.dtype, torch.float32)  # fp32 at least; fp64 stays fp64 (gradcheck)
        row_scale = mask.to(acc) / count
        grad = torch.empty_like(student) if ctx.needs_input_grad[0] else None
        rows_total, vocab = student.shape
        work = tuple(torch.empty((min(chunk, rows_total), vocab), dtype=acc, device=student.device) for _ in range(3))
        kl_sum = torch.zeros((), dtype=acc, device=student.device)
        ce_sum = torch.zeros((), dtype=acc, device=student.device)
        for start in range(0, rows_total, chunk):
            rows = slice(start, start + chunk)
            kl_rows, ce_rows = _kd_chunk(
                student[rows], teacher[rows], labels[rows], row_scale[rows], temperature, alpha, reverse, work,
                None if grad is None else grad[rows],
            )  # fmt: skip
            kl_sum += kl_rows.masked_fill(~mask[rows], 0.0).sum()
            ce_sum += ce_rows.masked_fill(~mask[rows], 0.0).sum()
        kl, ce = kl_sum / count, ce_sum / count
        total = alpha * temperature**2 * kl + (1.0 - alpha) * ce
        ctx.mark_non_differentiable(kl, ce)
        ctx.save_for_backward(grad if grad is not None else torch.empty(0))
        return total, kl, ce

    @staticmethod
    def backward(ctx, grad_total, _grad_kl, _grad_ce):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None, None, None, None


class ChunkedKDLoss(torch.nn.Module):
    """The KD objective of :func:`kd_loss`, computed ``chunk_tokens`` positions at a time.

    ``total = alpha · T² · KL + (1 − alpha) · CE`` over the scored positions (labels ≠ ``ignore_index``),
    with ``KL`` forward (``KL(p_teacher^T ‖ p_student^T)``, the default) or reverse.

    Why chunks: a naive implementation upcasts both ``(N, V)`` logit tensors to fp32, takes three
    log-softmaxes and keeps several full-vocabulary fp32 tensors alive for autograd. Here all fp32 work
    happens in place in three ``chunk_tokens × V`` buffers reused for every chunk, and the gradient with
    respect to the student logits is computed in closed form in the same pass and kept as the only
    full-size tensor (in the logits' dtype)::

        ∂/∂s [α·T²·KL_fwd] = α·T·(q − p)          ∂/∂s [α·T²·KL_rev] = α·T·q ⊙ (log q − log p − KL_rev)
        ∂/∂s [(1−α)·CE]     = (1−α)·(softmax(s) − onehot(y))

    each divided by ``|M|`` and zero on unscored rows. Backward then costs one multiply.
    """

    def __init__(
        self,
        *,
        temperature: float = 2.0,
        alpha: float = 0.5,
        divergence: Divergence = "forward",
        chunk_tokens: int = 256,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        super().__init__()
        if temperature <= 0 or not 0.0 <= alpha <= 1.0 or chunk_tokens <= 0:
            raise ValueError(
                "need temperature > 0, 0 <= alpha <= 1 and chunk_tokens > 0; "
                f"got {temperature}, {alpha}, {chunk_tokens}"
            )
        if divergence not in ("forward", "reverse"):
            raise ValueError(f"divergence must be 'forward' or 'reverse', got {divergence!r}")
        self.temperature, self.alpha, self.divergence = float(temperature), float(alpha), divergence
        self.chunk_tokens, self.ignore_index = chunk_tokens, ignore_index

    def forward(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor) -> KDTerms:
        """``student_logits``/``teacher_logits``: ``(..., V)`` (any float dtype); ``labels``: ``(...)``."""
        if student_logits.shape != teacher_logits.shape:
            raise ValueError(
                f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} "
                "differ; teacher and student must share a tokenizer and see the same batch"
            )
        vocab = student_logits.shape[-1]
        flat_labels = labels.reshape(-1)
        total, kl, ce = _ChunkedKD.apply(
            student_logits.reshape(-1, vocab),
            teacher_logits.detach().reshape(-1, vocab),
            flat_labels,
            self.temperature,
            self.alpha,
            self.divergence == "reverse",
            self.chunk_tokens,
            self.ignore_index,
        )
        return KDTerms(total, kl, ce, int((flat_labels != self.ignore_index).sum()))

    def extra_repr(self) -> str:
        return f"T={self.temperature}, alpha={self.alpha}, {self.divergence} KL, chunk_tokens={self.chunk_tokens}"
