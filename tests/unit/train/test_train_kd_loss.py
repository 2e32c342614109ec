"""The chunked KD loss against hand computations and against the unchunked autograd reference."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.train.losses import ChunkedKDLoss, kd_loss

STUDENT = torch.tensor([[[1.0, 2.0, 3.0], [0.5, -1.0, 4.0], [0.0, 0.0, 1.0]]])  # (batch 1, 3 positions, vocab 3)
TEACHER = torch.tensor([[[3.0, 2.0, 1.0], [1.0, 0.0, -1.0], [2.0, -2.0, 0.0]]])
LABELS = torch.tensor([[2, -100, 0]])  # the middle position (prompt or padding) is not scored


def _softmax(xs: list[float]) -> list[float]:
    exps = [math.exp(x) for x in xs]
    return [e / sum(exps) for e in exps]


def _hand(temperature: float, alpha: float, reverse: bool) -> tuple[float, float, float]:
    """total, KL, CE for STUDENT/TEACHER/LABELS, position by position with plain floats."""
    kls, ces = [], []
    for pos, label in ((0, 2), (2, 0)):  # scored positions only
        s, t = STUDENT[0, pos].tolist(), TEACHER[0, pos].tolist()
        p = _softmax([x / temperature for x in t])
        q = _softmax([x / temperature for x in s])
        a, b = (q, p) if reverse else (p, q)
        kls.append(sum(ai * (math.log(ai) - math.log(bi)) for ai, bi in zip(a, b, strict=True)))
        ces.append(-math.log(_softmax(s)[label]))
    kl, ce = sum(kls) / 2, sum(ces) / 2
    return alpha * temperature**2 * kl + (1 - alpha) * ce, kl, ce


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(("temperature", "alpha"), [(2.0, 0.3), (1.0, 0.5), (4.0, 1.0)])
def test_kd_loss_matches_hand_computation_with_t_squared_and_masking(temperature, alpha, reverse):
    total, kl, ce = _hand(temperature, alpha, reverse)
    divergence = "reverse" if reverse else "forward"
    ref = kd_loss(STUDENT, TEACHER, LABELS, temperature=temperature, alpha=alpha, divergence=divergence)
    chunked = ChunkedKDLoss(temperature=temperature, alpha=alpha, divergence=divergence, chunk_tokens=2)(
        STUDENT, TEACHER, LABELS
    )
    for got in (ref, (chunked.total, chunked.kl, chunked.ce)):
        assert [float(x) for x in got] == pytest.approx([total, kl, ce], rel=1e-6)
    assert chunked.n_tokens == 2


def test_t_squared_factor_scales_the_kl_term():
    loss = ChunkedKDLoss(temperature=3.0, alpha=1.0)(STUDENT, TEACHER, LABELS)
    assert float(loss.total) == pytest.approx(9.0 * float(loss.kl), rel=1e-6)


def test_unscored_positions_do_not_change_loss_or_receive_gradient():
    student = STUDENT.clone().requires_grad_(True)
    changed_teacher = TEACHER.clone()
    changed_teacher[0, 1] = torch.tensor([-5.0, 9.0, 0.0])  # a different teacher at the masked position
    base = ChunkedKDLoss()(student, TEACHER, LABELS)
    other = ChunkedKDLoss()(student, changed_teacher, LABELS)
    assert base.total.item() == other.total.item()
    base.total.backward()
    assert student.grad[0, 1].eq(0).all() and student.grad[0, 0].abs().sum() > 0


def test_alpha_zero_is_cross_entropy_and_nothing_scored_is_zero():
    ce = torch.nn.functional.cross_entropy(STUDENT[0, [0, 2]], torch.tensor([2, 0]))
    assert float(ChunkedKDLoss(alpha=0.0)(STUDENT, TEACHER, LABELS).total) == pytest.approx(float(ce), rel=1e-6)
    none = ChunkedKDLoss()(STUDENT, TEACHER, torch.full_like(LABELS, -100))
    assert float(none.total) == 0.0 and none.n_tokens == 0


def test_zero_kl_when_student_equals_teacher_and_no_gradient_reaches_the_teacher():
    student = TEACHER.clone().requires_grad_(True)
    teacher = TEACHER.clone().requires_grad_(True)
    terms = ChunkedKDLoss(alpha=1.0)(student, teacher, LABELS)
    assert float(terms.kl) == pytest.approx(0.0, abs=1e-7)
    terms.total.backward()
    assert student.grad.abs().max() < 1e-6 and teacher.grad is None


@pytest.mark.parametrize("divergence", ["forward", "reverse"])
@pytest.mark.parametrize("chunk_tokens", [1, 3, 7, 1000])
def test_chunked_equals_unchunked_in_value_and_gradient(divergence, chunk_tokens):
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(3, 7, 50, generator=gen, requires_grad=True)
    teacher = torch.randn(3, 7, 50, generator=gen)
    labels = torch.randint(0, 50, (3, 7), generator=gen)
    labels[0, :4] = -100  # prompt
    labels[2, 5:] = -100  # padding
    ref = kd_loss(student, teacher, labels, temperature=2.0, alpha=0.4, divergence=divergence)
    (ref_grad,) = torch.autograd.grad(ref[0], student)
    got = ChunkedKDLoss(temperature=2.0, alpha=0.4, divergence=divergence, chunk_tokens=chunk_tokens)(
        student, teacher, labels
    )
    (got_grad,) = torch.autograd.grad(got.total * 3.0, student)  # the upstream gradient is applied
    assert float(got.total) == pytest.approx(float(ref[0]), rel=1e-5)
    assert float(got.kl) == pytest.approx(float(ref[1]), rel=1e-5)
    assert torch.allclose(got_grad, 3.0 * ref_grad, atol=1e-7, rtol=1e-4)


@pytest.mark.parametrize("divergence", ["forward", "reverse"])
def test_closed_form_gradient_passes_gradcheck_in_float64(divergence):
    gen = torch.Generator().manual_seed(1)
    student = torch.randn(2, 4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(2, 4, 6, generator=gen, dtype=torch.float64)
    labels = torch.tensor([[1, -100, 3, 5], [0, 2, -100, -100]])
    loss = ChunkedKDLoss(temperature=1.7, alpha=0.6, divergence=divergence, chunk_tokens=3)
    assert torch.autograd.gradcheck(lambda s: loss(s, teacher, labels).total, (student,))


def test_bf16_logits_give_fp32_loss_close_to_fp32_reference():
    gen = torch.Generator().manual_seed(2)
    student = torch.randn(2, 5, 40, generator=gen)
    teacher = torch.randn(2, 5, 40, generator=gen)
    labels = torch.randint(0, 40, (2, 5), generator=gen)
    ref = ChunkedKDLoss()(student, teacher, labels)
    half = ChunkedKDLoss()(student.bfloat16().requires_grad_(True), teacher.bfloat16(), labels)
    assert half.total.dtype == torch.float32
    assert float(half.total) == pytest.approx(float(ref.total), rel=2e-2)


def test_mismatched_vocabularies_are_a_one_line_error():
    with pytest.raises(ValueError, match=r"student logits \(1, 3, 3\) and teacher logits \(1, 3, 4\) differ") as info:
        ChunkedKDLoss()(STUDENT, torch.zeros(1, 3, 4), LABELS)
    assert "\n" not in str(info.value)
