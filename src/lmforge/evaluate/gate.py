"""The promotion gate: thresholds a candidate must meet, checked against evaluation results.

``results`` is the mapping written as ``results.json`` by :mod:`lmforge.evaluate.evaluate`; the gate
reads only::

    {"models": {"student": {"perplexity": ...},
                "onnx_fp32": {"perplexity": ...},
                "int8_dynamic": {"perplexity": ...},
                "<served model>": {"p99_ms": ...}},      # batch-1 forward pass
     "served_model": "<served model>"}

A value that is missing (model not evaluated, key absent, ``None``) or not a finite number fails its
check with a reason; nothing passes by default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from lmforge.config import GateConfig

STUDENT = "student"
FP32 = "onnx_fp32"
INT8 = "int8_dynamic"


@dataclass(frozen=True)
class Check:
    """One gate criterion: ``value`` must be ≤ ``threshold``."""

    name: str
    value: float | None
    threshold: float
    passed: bool
    reason: str


@dataclass(frozen=True)
class GateDecision:
    """All checks, and whether every one passed."""

    passed: bool
    checks: list[Check] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping (for JSON)."""
        return {"passed": self.passed, "checks": [asdict(c) for c in self.checks]}


def _number(results: Mapping[str, Any], model: str | None, key: str) -> tuple[float | None, str]:
    """``results["models"][model][key]`` as a finite float, or ``None`` and why not."""
    if not model:
        return None, "no served model named in the results"
    entry = (results.get("models") or {}).get(model)
    if entry is None:
        return None, f"model {model!r} was not evaluated"
    value = entry.get(key)
    if value is None:
        return None, f"{model}.{key} is missing"
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None, f"{model}.{key} is not a finite number ({value!r})"
    return float(value), ""


def _at_most(name: str, value: float | None, threshold: float, missing: str, what: str) -> Check:
    if value is None:
        return Check(name, None, threshold, False, f"{missing}; cannot check {what}")
    passed = value <= threshold
    relation = "≤" if passed else ">"
    verdict = "ok" if passed else "too high"
    return Check(name, value, threshold, passed, f"{what} {value:.6g} {relation} {threshold:.6g}: {verdict}")


def check_student_perplexity(cfg: GateConfig, results: Mapping[str, Any]) -> Check:
    """The distilled student's held-out perplexity is at most ``max_student_perplexity``."""
    value, missing = _number(results, STUDENT, "perplexity")
    return _at_most("student_perplexity", value, cfg.max_student_perplexity, missing, "student perplexity")


def check_int8_delta(cfg: GateConfig, results: Mapping[str, Any]) -> Check:
    """INT8 (dynamic) perplexity exceeds ONNX FP32 perplexity by at most ``max_int8_perplexity_delta``.

    The value is the relative delta ``(ppl_int8 - ppl_fp32) / ppl_fp32``; an INT8 model that scores
    better than FP32 has a negative delta and passes.
    """
    int8, missing_int8 = _number(results, INT8, "perplexity")
    fp32, missing_fp32 = _number(results, FP32, "perplexity")
    value: float | None = None
    missing = "; ".join(m for m in (missing_int8, missing_fp32) if m)
    if int8 is not None and fp32 is not None:
        if fp32 > 0:
            value = (int8 - fp32) / fp32
        else:
            missing = f"{FP32}.perplexity is {fp32}, not positive"
    return _at_most(
        "int8_perplexity_delta",
        value,
        cfg.max_int8_perplexity_delta,
        missing,
        "INT8 relative perplexity delta",
    )


def check_served_latency(cfg: GateConfig, results: Mapping[str, Any]) -> Check:
    """The served model's batch-1 p99 forward latency is at most ``max_latency_ms``."""
    served = results.get("served_model")
    value, missing = _number(results, served, "p99_ms")
    what = f"served model ({served}) p99 latency ms" if served else "served model p99 latency ms"
    return _at_most("served_p99_latency_ms", value, cfg.max_latency_ms, missing, what)


def check_gate(cfg: GateConfig, results: Mapping[str, Any]) -> GateDecision:
    """Run every check; the gate passes only when all do."""
    checks = [
        check_student_perplexity(cfg, results),
        check_int8_delta(cfg, results),
        check_served_latency(cfg, results),
    ]
    return GateDecision(passed=all(c.passed for c in checks), checks=checks)
