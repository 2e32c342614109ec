"""Plan against actual: each training stage's plan (preflight's) beside what its training history measured.

The plan (:func:`lmforge.plan.plan_record`) gives per stage the tokens, hours, GPU-hours, MFU and memory per GPU
on the planned accelerator. The actual side comes from the ``training_history.json`` next to the stage's model
(``base`` for pretrain, ``teacher`` for finetune_lora, ``student`` for distill): ``total_tokens``,
``train_seconds`` (hours; GPU-hours with the world size the model's manifest records, else the planned GPUs), the
last MFU measured and the peak ``memory_gb``. The history's memory is GiB of CUDA allocations on a GPU and the
process's peak resident set on a CPU; it is shown in GB like the plan. A device without a known peak FLOP/s (a CPU,
as in the local demo) measures no MFU: the note says so, and that the actual figures are that device's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

STAGE_MODELS = {"pretrain": "base", "finetune_lora": "teacher", "distill": "student"}
"""The evaluated model each training stage's history is found next to."""
FIGURES = (
    ("tokens", "tokens"),
    ("hours", "hours"),
    ("gpu_hours", "GPU-hours"),
    ("mfu", "MFU"),
    ("memory_gb_per_gpu", "memory per GPU (GB)"),
)
"""The figures compared, by key, with their labels."""
_GIB = 2**30


def actual_figures(history: Mapping[str, Any], gpus: int) -> dict[str, float | None]:
    """What a training history measured, in the plan's terms (``None`` where it measured nothing)."""
    hours = float(history.get("train_seconds") or 0.0) / 3600
    mfu = [value for value in history.get("mfu") or [] if value is not None]
    memory = [value for value in history.get("memory_gb") or [] if value is not None]
    return {
        "tokens": float(history.get("total_tokens") or 0),
        "hours": hours,
        "gpu_hours": hours * gpus,
        "mfu": mfu[-1] if mfu else None,
        "memory_gb_per_gpu": max(memory) * _GIB / 1e9 if memory else None,
    }


def plan_against_actual(
    plan: Mapping[str, Any] | None,
    histories: Mapping[str, Mapping[str, Any]],
    world_sizes: Mapping[str, int] | None = None,
) -> dict[str, Any] | None:
    """Rows ``{stage, figure, planned, actual, ratio}`` for every planned stage and :data:`FIGURES` figure, with the
    accelerator planned for and a note on what the actual side is; ``None`` without a plan.

    Args:
        plan: preflight's plan.
        histories: training histories by evaluated model name (``base``, ``teacher``, ``student``).
        world_sizes: training processes by model name, where the model's manifest records them.
    """
    if not plan or not plan.get("stages"):
        return None
    rows = []
    measured_mfu = False
    for stage in plan["stages"]:
        model = STAGE_MODELS.get(stage["stage"], "")
        history = histories.get(model)
        gpus = (world_sizes or {}).get(model) or int(stage["gpus"])
        actual = actual_figures(history, gpus) if history is not None else {}
        measured_mfu |= actual.get("mfu") is not None
        for key, label in FIGURES:
            planned, measured = stage.get(key), actual.get(key)
            ratio = measured / planned if measured is not None and planned else None
            row = {"stage": stage["stage"], "figure": label, "planned": planned, "actual": measured}
            rows.append(row | {"ratio": ratio})
    return {
        "accelerator": plan.get("accelerator", {}),
        "mfu_sources": {stage["stage"]: stage["mfu_source"] for stage in plan["stages"]},
        "rows": rows,
        "note": _note(plan, measured_mfu),
    }


def _note(plan: Mapping[str, Any], measured_mfu: bool) -> str:
    accelerator = plan.get("accelerator", {})
    gpus = plan["stages"][0].get("gpus")
    planned = (
        f"Planned for {gpus} × {accelerator.get('name')} ({accelerator.get('peak_flops', 0) / 1e12:.0f} TFLOP/s dense "
        f"bf16, {accelerator.get('memory_gb', 0):.0f} GB; {accelerator.get('source', 'source not recorded')}); "
        "actual from each stage's training history."
    )
    if measured_mfu:
        return planned
    return (
        f"{planned} No stage measured MFU: the training device has no known peak FLOP/s (a CPU, as in the local "
        "demo, or a GPU missing from the peak table), so the actual hours are that device's and its memory is the "
        "process's peak resident set, not GPU memory."
    )
