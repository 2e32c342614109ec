"""Glue between stage results and KFP output artifacts, without importing ``kfp``.

Components pass their ``Output[Metrics]`` / ``Output[HTML]`` / ``Output[Markdown]`` objects here; only
their ``path`` attribute and ``log_metric`` method are used, so this module stays KFP-free and testable.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Protocol

from lmforge.contracts import metric_name_with_scale
from lmforge.results import StageResult

log = logging.getLogger("lmforge.component")


class MetricsSink(Protocol):
    """What KFP's ``Metrics`` artifact offers."""

    def log_metric(self, metric: str, value: float) -> None: ...


class FileArtifact(Protocol):
    """Any KFP artifact: a ``path`` to write."""

    path: str


# At DEBUG these log every request's headers and signing steps: X-Amz-Security-Token, and the access key id in
# Authorization. They stay at INFO even in verbose mode, so that no log line carries a credential.
CREDENTIAL_LOGGERS = ("botocore", "boto3", "s3transfer", "urllib3")


def cap_credential_loggers() -> None:
    """Keep the AWS SDK and HTTP loggers at INFO or above whatever the root level (see ``CREDENTIAL_LOGGERS``)."""
    for name in CREDENTIAL_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(max(logger.level, logging.INFO))


def setup_logging(level: int = logging.INFO) -> None:
    """Plain timestamped logs on stderr for a component's container; never a credential, even at DEBUG."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    cap_credential_loggers()


def publish(
    result: StageResult,
    *,
    metrics: MetricsSink | None = None,
    html: FileArtifact | None = None,
    markdown: FileArtifact | None = None,
    markdown_text: str | None = None,
) -> None:
    """Log finite scalar metrics (Q&A metrics named with their range, see
    :func:`~lmforge.contracts.metric_name_with_scale`) and write the stage's HTML/Markdown reports to KFP outputs."""
    if metrics is not None:
        for name, value in sorted(result.metrics.items()):
            if isinstance(value, bool | int | float) and math.isfinite(float(value)):
                metrics.log_metric(metric_name_with_scale(name), float(value))
            else:
                log.warning("metric %s=%r is not a finite number; not logged", name, value)
    if html is not None:
        _write(html, result.html or "<!DOCTYPE html><html><body><p>No report.</p></body></html>")
    if markdown is not None:
        _write(markdown, markdown_text or "")


def _write(artifact: FileArtifact, text: str) -> None:
    path = Path(artifact.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
