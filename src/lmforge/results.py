"""What every stage's entry function returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StageResult:
    """Outcome of one stage run.

    Attributes:
        metrics: scalar figures; components log them as KFP ``Metrics``.
        html: an optional self-contained HTML report for people.
        summary: non-scalar facts (statuses, paths, reasons) for logs, manifests and callers; a stage's
            output parameters (``StageSpec.returns``) by name.
        markdown: an optional Markdown summary (the Kubeflow UI renders a ``Markdown`` output).
    """

    metrics: dict[str, float] = field(default_factory=dict)
    html: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    markdown: str | None = None
