"""The MFU each training stage measured in the newest pipeline run of a preset, read back from MLflow.

A pipeline run's parent MLflow run carries its preset (tag ``lmforge.preset``) and every stage's final figures as
``<stage>.<name>`` (:mod:`lmforge.tracking.runs`), so a stage that measured its model FLOPs utilization left
``<stage>.mfu`` there. The training plan uses that figure in place of the assumed one. With tracking off, or a
server that does not answer (one warning, as for every tracking call), there is no record and the plan assumes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from lmforge.config.tracking import TrackingConfig
from lmforge.tracking.runs import PARENT_TAG, PRESET_TAG, Tracker
from lmforge.tracking.session import Unavailable

_SEARCHABLE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a preset name that needs no quoting in a filter


def measured_mfu(
    preset: str, stages: Iterable[str], *, cfg: TrackingConfig | None = None
) -> dict[str, tuple[float, str]]:
    """Per stage, ``(MFU, MLflow run id)`` of the newest pipeline run of ``preset`` that recorded ``<stage>.mfu``.

    Stages without such a run are left out; so is every stage when tracking is off, the server does not answer or
    ``preset`` is not a plain name (a preset file's path).
    """
    session = Tracker(cfg).session
    if session is None or not _SEARCHABLE.match(preset):
        return {}
    found: dict[str, tuple[float, str]] = {}
    for stage in stages:
        key = f"{stage}.mfu"
        try:
            runs = session.search_runs(
                f"find the last measured {key} of preset {preset}",
                f"tags.`{PRESET_TAG}` = '{preset}' and tags.`{PARENT_TAG}` IS NULL and metrics.`{key}` > 0",
                max_results=1,
                order_by=["attributes.start_time DESC"],
            )
        except Unavailable:
            return found
        if runs and 0 < (value := runs[0].data.metrics[key]) <= 1:
            found[stage] = (value, runs[0].info.run_id)
    return found
