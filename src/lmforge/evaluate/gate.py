"""The promotion gate: thresholds a candidate must meet, alone and against the production release.

``results`` is the mapping written as ``results.json`` by :mod:`lmforge.evaluate.evaluate`; the gate
reads only::

    {"models": {"student": {"perplexity": ..., "bits_per_byte": ..., "exact_match": ...},
                "onnx_fp32": {"perplexity": ...},
                "int8_dynamic": {"perplexity": ...},
                "<served model>": {"p99_ms": ...}},      # batch-1 forward pass
     "served_model": "<served model>",
     "production": {"status": "found", "version": ..., "metrics": {"student_bits_per_byte": ...,
                                                                   "student_exact_match": ...}}
                   | {"status": "none", "reason": ...}}

A value that is missing (model not evaluated, key absent, ``None``) or not a finite number fails its
check with a reason; nothing passes by default. Two things pass explicitly, with a reason saying so: a
check whose threshold is configured as null (disabled), and a comparison with production when there is
no production release yet (the first promotion). Production is compared on bits per byte, not
perplexity, because a retrained tokenizer changes what a token is but not what a byte is.
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
    """One gate criterion: ``value`` compared with ``threshold`` (``≤`` or ``≥`` as the reason says)."""

    name: str
    value: float | None
    threshold: float | None
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


def _finite(value: Any, where: str) -> tuple[float | None, str]:
    if value is None:
        return None, f"{where} is missing"
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None, f"{where} is not a finite number ({value!r})"
    return float(value), ""


def _number(results: Mapping[str, Any], model: str | None, key: str) -> tuple[float | None, str]:
    """``results["models"][model][key]`` as a finite float, or ``None`` and why not."""
    if not model:
        return None, "no served model named in the results"
    entry = (results.get("models") or {}).get(model)
    if entry is None:
        return None, f"model {model!r} was not evaluated"
    return _finite(entry.get(key), f"{model}.{key}")


def _at_most(name: str, value: float | None, threshold: float, missing: str, what: str) -> Check:
    if value is None:
        return Check(name, None, threshold, False, f"{missing}; cannot check {what}")
    passed = value <= threshold
    relation = "≤" if passed else ">"
    verdict = "ok" if passed else "too high"
    return Check(name, value, threshold, passed, f"{what} {value:.6g} {relation} {threshold:.6g}: {verdict}")


def _at_least(name: str, value: float | None, threshold: float, missing: str, what: str) -> Check:
    if value is None:
        return Check(name, None, threshold, False, f"{missing}; cannot check {what}")
    passed = value >= threshold
    relation = "≥" if passed else "<"
    verdict = "ok" if passed else "too low"
    return Check(name, value, threshold, passed, f"{what} {value:.6g} {relation} {threshold:.6g}: {verdict}")


def _disabled(name: str, setting: str) -> Check:
    return Check(name, None, None, True, f"disabled ({setting} is null)")


def check_student_perplexity(cfg: GateConfig, results: Mapping[str, Any]) -> Check:
    """The distilled student's held-out perplexity is at most ``max_student_perplexity``."""
    value, missing = _number(results, STUDENT, "perplexity")
    return _at_most("student_perplexity", value, cfg.max_student_perplexity, missing, "student perplexity")


def check_int8_delta(cfg: GateConfig, results: Mapping[str, Any]) -> Check:
    """INT8 (dynamic) perplexity exceeds ONNX FP32 perplexity by at most ``max_int8_perplexity_delta``.

    The value is the relative delta ``(ppl_int8 - ppl_fp32) / ppl_fp32``; an INT8 model that scores
    better than FP32 has a negative delta and passes. An INT8 model the quantize stage already rejected
    is not served (the FP32 model is), so the check passes and says so.
    """
    int8, missing_int8 = _number(results, INT8, "perplexity")
    fp32, missing_fp32 = _number(results, FP32, "perplexity")
    entry = (results.get("models") or {}).get(INT8) or {}
    if entry.get("accepted") is False:
        reason = entry.get("gate_reason", "rejected")
        return Check(
            "int8_perplexity_delta",
            None,
            cfg.max_int8_perplexity_delta,
            True,
            f"INT8 rejected by the quantize accuracy gate ({reason}); serving falls back to FP32",
        )
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


def check_student_exact_match(cfg: GateConfig, results: Mapping[str, Any]) -> Check:
    """The student's exact match on held-out Q&A is at least ``min_student_exact_match``."""
    name = "student_exact_match"
    if cfg.min_student_exact_match is None:
        return _disabled(name, "min_student_exact_match")
    value, missing = _number(results, STUDENT, "exact_match")
    return _at_least(name, value, cfg.min_student_exact_match, missing, "student exact match")


def _production(results: Mapping[str, Any], metric: str) -> tuple[float | None, str, str | None]:
    """``(value, why missing, version)`` of a production metric; version ``None`` when there is no release."""
    production = results.get("production") or {}
    status = production.get("status")
    if status == "none":
        return None, str(production.get("reason") or "no production release"), None
    if status != "found":
        return None, "the production release was not looked up", ""
    version = str(production.get("version"))
    value, missing = _finite((production.get("metrics") or {}).get(metric), f"production {version} {metric}")
    return value, missing, version


def _no_production_yet(name: str, threshold: float, reason: str) -> Check:
    return Check(name, None, threshold, True, f"{reason}: nothing to compare with (first release)")


def check_bits_per_byte_vs_production(cfg: GateConfig, results: Mapping[str, Any]) -> Check:
    """Student bits per byte is at most production's times ``1 + max_bits_per_byte_regression``.

    The value is the relative regression ``(bpb - bpb_production) / bpb_production``; better is negative.
    """
    name = "bits_per_byte_vs_production"
    margin = cfg.max_bits_per_byte_regression
    if margin is None:
        return _disabled(name, "max_bits_per_byte_regression")
    prod, prod_missing, version = _production(results, "student_bits_per_byte")
    if version is None:
        return _no_production_yet(name, margin, prod_missing)
    cand, cand_missing = _number(results, STUDENT, "bits_per_byte")
    value: float | None = None
    missing = "; ".join(m for m in (cand_missing, prod_missing) if m)
    if cand is not None and prod is not None:
        if prod > 0:
            value = (cand - prod) / prod
        else:
            missing = f"production {version} student_bits_per_byte is {prod}, not positive"
    what = f"student bits/byte regression vs production {version}"
    return _at_most(name, value, margin, missing, what)


def check_exact_match_vs_production(cfg: GateConfig, results: Mapping[str, Any]) -> Check:
    """Student exact match is at most ``max_exact_match_regression`` below production's (absolute)."""
    name = "exact_match_vs_production"
    margin = cfg.max_exact_match_regression
    if margin is None:
        return _disabled(name, "max_exact_match_regression")
    prod, prod_missing, version = _production(results, "student_exact_match")
    if version is None:
        return _no_production_yet(name, margin, prod_missing)
    cand, cand_missing = _number(results, STUDENT, "exact_match")
    value = prod - cand if cand is not None and prod is not None else None
    missing = "; ".join(m for m in (cand_missing, prod_missing) if m)
    what = f"student exact-match drop vs production {version}"
    return _at_most(name, value, margin, missing, what)


CHECKS = (
    check_student_perplexity,
    check_int8_delta,
    check_served_latency,
    check_student_exact_match,
    check_bits_per_byte_vs_production,
    check_exact_match_vs_production,
)
"""Every check, in report order."""


def check_gate(cfg: GateConfig, results: Mapping[str, Any]) -> GateDecision:
    """Run every check; the gate passes only when all do."""
    checks = [check(cfg, results) for check in CHECKS]
    return GateDecision(passed=all(c.passed for c in checks), checks=checks)
