"""The ``plan_dedup`` stage: the task indices of the partitioned dedup's two fan-outs."""

from __future__ import annotations

from lmforge.config import CleanConfig
from lmforge.data.dedup_files import at_least_one, band_ranges
from lmforge.results import StageResult


def run(cfg: CleanConfig, *, band_groups: int, parts: int) -> StageResult:
    """The ``plan_dedup`` stage: the task indices of the exact and the band fan-out.

    Exact part ``p`` owns the documents whose digest hashes to ``p`` of ``parts``; band task ``t`` is band
    group ``t // parts`` (of ``band_groups``, at most one per LSH band) and part ``t % parts`` of its bucket
    keys. Only integers, so that the KFP backend's drivers accept every loop item.

    Raises:
        ConfigError: ``band_groups`` or ``parts`` is below 1.
    """
    at_least_one(band_groups=band_groups, parts=parts)
    groups = len(band_ranges(cfg.near_dedup.bands, band_groups))
    metrics = {"exact_parts": float(parts), "band_groups": float(groups), "band_tasks": float(groups * parts)}
    summary = {"exact_parts": list(range(parts)), "band_tasks": list(range(groups * parts))}
    return StageResult(metrics=metrics, summary=summary)
