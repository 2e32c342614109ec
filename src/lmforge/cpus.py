"""How many CPUs this process may use: the pod's CPU limit (cgroup v2 or v1 quota) or the CPU affinity mask."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_V2_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def cgroup_cpu_limit(
    cpu_max: Path = CGROUP_V2_CPU_MAX, v1_quota: Path = CGROUP_V1_QUOTA, v1_period: Path = CGROUP_V1_PERIOD
) -> float | None:
    """The CPU limit of this container (``quota / period``; e.g. 1.5), or None when it has none.

    cgroup v2 writes ``"<quota> <period>"`` or ``"max <period>"`` to ``cpu.max``; cgroup v1 a quota of -1
    for no limit. A Kubernetes ``resources.limits.cpu`` ends up here.
    """
    try:
        quota, period = cpu_max.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us, period_us = int(v1_quota.read_text()), int(v1_period.read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def available_cpus() -> int:
    """CPUs to size a worker pool by: the affinity mask, capped by the cgroup limit rounded up (at least 1)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        affinity = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return max(1, min(affinity, math.ceil(limit)) if limit is not None else affinity)
