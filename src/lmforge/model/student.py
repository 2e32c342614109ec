"""The distilled student's shape: which teacher blocks its blocks come from.

Shared by the ``distill`` stage, which builds the student, and the training plan (:mod:`lmforge.plan`), which sizes it.
"""

from __future__ import annotations


def student_layers(n_teacher: int, fraction: float) -> list[int]:
    """Teacher block indices the student's blocks come from: ``m = max(1, round(fraction·n))`` blocks,
    block ``i`` from teacher block ``floor(i·n/m)`` (every k-th block when ``m`` divides ``n``)."""
    m = max(1, round(fraction * n_teacher))
    return [i * n_teacher // m for i in range(m)]
