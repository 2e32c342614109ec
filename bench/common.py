"""What every benchmark shares: the facts of the machine it ran on, its tables, and its JSON record.

A figure means little without the machine and its load, so every record written by :func:`write_results`
carries :func:`machine_facts` under ``"machine"``.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import time
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from lmforge.cpus import available_cpus, cgroup_cpu_limit

RESULTS = Path(__file__).resolve().parent / "results"
_CPUINFO = Path("/proc/cpuinfo")
_MEMINFO = Path("/proc/meminfo")
# cgroup v2, then v1; v1 writes a number near 2**63 for "no limit"
_MEMORY_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
_NO_MEMORY_LIMIT = 1 << 60


def package_versions(*names: str) -> dict[str, str]:
    """The installed version of each distribution, or ``"not installed"``."""
    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def _first_cpu() -> dict[str, str]:
    """The ``key: value`` fields of the first processor in ``/proc/cpuinfo`` (empty off Linux)."""
    fields: dict[str, str] = {}
    if _CPUINFO.is_file():
        for line in _CPUINFO.read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    return fields


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``avx512_bf16``, ``amx_bf16``...; empty off Linux)."""
    return set(_first_cpu().get("flags", "").split())


def _memory_gb() -> float | None:
    """Physical memory in GiB (``MemTotal``), or None off Linux."""
    if _MEMINFO.is_file():
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    return None


def _memory_limit_gb() -> float | None:
    """The container's memory limit in GiB (cgroup v2 or v1), or None when it has none."""
    for path in _MEMORY_LIMITS:
        if path.is_file():
            text = path.read_text().strip()
            return None if text == "max" or int(text) >= _NO_MEMORY_LIMIT else round(int(text) / 2**30, 1)
    return None


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded to 0.01."""
    return [round(x, 2) for x in os.getloadavg()]


def machine_facts() -> dict[str, Any]:
    """The machine now: date, platform, CPU model and count, cgroup CPU limit, memory, load, Python/torch/ORT."""
    return {
        "date": time.strftime("%Y-%m-%d"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": _first_cpu().get("model name") or platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "cpu_limit": cgroup_cpu_limit(),
        "available_cpus": available_cpus(),
        "memory_gb": _memory_gb(),
        "memory_limit_gb": _memory_limit_gb(),
        "load_average": load_average(),
        "python": platform.python_version(),
        **package_versions("torch", "onnxruntime"),
    }


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cell(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def text_table(
    header: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    widths: Sequence[int] | None = None,
    align: str | None = None,
    sep: str = "  ",
    rule: bool = False,
) -> str:
    """Rows under a header in padded columns.

    Args:
        rows: the cells; a float is written with 3 significant digits, anything else with ``str``.
        widths: each column's width (default: its widest cell); a longer cell is not cut.
        align: ``<`` (left) or ``>`` (right) per column (default: the first left, the others right).
        sep: what stands between two columns.
        rule: a line of dashes, as long as the header line, under it.
    """
    cells = [[_cell(c) for c in row] for row in [header, *rows]]
    widths = widths or [max(len(row[i]) for row in cells) for i in range(len(header))]
    align = align or "<" + ">" * (len(header) - 1)
    lines = [
        sep.join(c.ljust(w) if a == "<" else c.rjust(w) for c, w, a in zip(row, widths, align, strict=True))
        for row in cells
    ]
    if rule:
        lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table of ``rows`` (cells written as :func:`text_table` writes them)."""
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def result_path(name: str) -> Path:
    """Where :func:`write_results` writes ``name`` by default: ``bench/results/<name>.json``."""
    return RESULTS / f"{name}.json"


def write_results(
    name: str,
    payload: Mapping[str, Any],
    *,
    path: Path | None = None,
    machine: Mapping[str, Any] | None = None,
    merge: bool = False,
) -> Path:
    """Write ``{"machine": ..., **payload}`` as JSON to :func:`result_path` (or ``path``); return the path.

    Args:
        machine: the machine facts to record (default: :func:`machine_facts` now; a long benchmark passes those
            it took when it started, with its own additions).
        merge: keep the other top-level keys of an existing file (benchmarks whose sections run one at a time).
    """
    if "machine" in payload:
        raise ValueError(f"{name}: the payload holds a 'machine' key; pass machine= instead")
    path = path or result_path(name)
    record = {"machine": dict(machine) if machine is not None else machine_facts(), **payload}
    if merge and path.is_file():
        record = json.loads(path.read_text(encoding="utf-8")) | record
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return path
