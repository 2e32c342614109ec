"""The promotion gate: thresholds a candidate must meet, alone, against the teacher and the base model it came
from, and against the production release.

``results`` is the mapping written as ``results.json`` by :mod:`lmforge.evaluate.evaluate`; the gate
reads only::

    {"models": {"student": {"perplexity": ..., "bits_per_byte": ..., "exact_match": ..., "f1": ...,
                            "empty_answer_fraction": ..., "answer_loss": ...},
                "teacher": {"bits_per_byte": ..., "f1": ..., "answer_loss": ...},
                "base": {"bits_per_byte": ...},
                "onnx_fp32": {"perplexity": ...},
                "int8_dynamic": {"perplexity": ...},
                "<served model>": {"p99_ms": ..., "answer_loss": ...}},      # batch-1 forward pass
     "served_model": "<served model>",
     "production": {"status": "found", "version": ..., "metrics": {"student_bits_per_byte": ...,
                                                                   "student_exact_match": ...}}
                   | {"status": "none", "reason": ...},
     "data": {"clean": {"metrics": {"docs_in": ..., "docs_out": ..., "bytes_in": ..., "bytes_out": ...}}}}

A value that is missing (model not evaluated, key absent, ``None``) or not a finite number fails its
check with a reason; nothing passes by default. Each check ends in one of four states (:attr:`Check.status`):

- ``pass``: the value was compared with a threshold and met it, on enough data;
- ``fail``: the value missed the threshold, or is missing;
- ``n/a``: the comparison says nothing, and the reason says why: a threshold that no value can miss
  (``min_student_exact_match`` 0), a zero baseline (a teacher F1 of 0 leaves no F1 to lose; a production exact
  match of 0 none to drop), nothing to compare with (no production release yet, no base model evaluated, no
  cleaning statistics, an INT8 model that is not served, a harness task of which no item fit the model's context),
  no failing threshold (``min_retention`` null), or a value that would pass but rests on a held-out set below the
  configured minimum (``results["confidence"]``: "low confidence: N tokens / M documents" or "M prompts"); a value
  that fails on such a set still fails;
- ``off``: the check is disabled (its threshold configured as null).

An n/a check is never counted as passed. The gate passes when no check fails and every check named in
``gate.required`` passes; an n/a check outside ``required`` does not stop a promotion, and the decision lists it
(:attr:`GateDecision.not_applicable`) in the report, the console and the gate record. Production and the base
model are compared on bits per byte, not perplexity, because a retrained tokenizer changes what a token is but
not what a byte is.

Relative checks compare the candidate with the model it was made from, so that a useless model cannot pass
on absolute thresholds that a tiny model meets anyway: the served model's held-out answer loss against the
teacher's, the student's F1 against the teacher's, the share of empty answers, and bits per byte of the
teacher and the student against the base (what fine-tuning and distillation forgot). The retention check
also warns below ``retention_warning``: a check carries an optional ``warning``, and
:attr:`GateDecision.warnings` lists them for the report and the run's last lines.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from lmforge.config import GateConfig
from lmforge.config.evaluate import HarnessCheck
from lmforge.evaluate.harness import all_skipped

STUDENT = "student"
TEACHER = "teacher"
BASE = "base"
FP32 = "onnx_fp32"
INT8 = "int8_dynamic"

PASS = "pass"
FAIL = "fail"
NOT_APPLICABLE = "n/a"
OFF = "off"
_MARKS = {PASS: "PASS", FAIL: "FAIL", NOT_APPLICABLE: "n/a", OFF: "off"}

TEXT = "text"
QA = "qa"
DATA_OF_CHECK = {
    "student_perplexity": TEXT,
    "int8_perplexity_delta": TEXT,
    "teacher_forgetting": TEXT,
    "student_forgetting": TEXT,
    "bits_per_byte_vs_production": TEXT,
    "student_exact_match": QA,
    "answer_loss_vs_teacher": QA,
    "f1_vs_teacher": QA,
    "served_empty_answers": QA,
    "exact_match_vs_production": QA,
}
"""The held-out set each check's value rests on: ``text`` (the val split) or ``qa`` (the held-out prompts)."""


@dataclass(frozen=True)
class Check:
    """One gate criterion: ``value`` compared with ``threshold`` (``≤`` or ``≥`` as the reason says), and its
    ``status``: ``pass``, ``fail``, ``n/a`` (the comparison says nothing; the reason says why) or ``off``."""

    name: str
    value: float | None
    threshold: float | None
    status: str
    reason: str
    warning: str | None = None

    @property
    def passed(self) -> bool:
        """Whether the check passed (``n/a`` and ``off`` did not)."""
        return self.status == PASS


def check_status(check: Mapping[str, Any]) -> str:
    """The status of a check as ``results.json`` holds it (one written without a status: from ``passed``)."""
    status = check.get("status")
    return status if status in _MARKS else PASS if check.get("passed") else FAIL


def check_mark(check: Mapping[str, Any]) -> str:
    """How a check's status reads in a report, a log or a tag: ``PASS``, ``FAIL``, ``n/a`` or ``off``."""
    return _MARKS[check_status(check)]


@dataclass(frozen=True)
class GateDecision:
    """All checks, and whether the candidate may be promoted: no check failed and every required one passed."""

    passed: bool
    checks: list[Check] = field(default_factory=list)
    required: tuple[str, ...] = ()

    @property
    def failed(self) -> list[str]:
        """Names of the checks that stop the promotion: failed ones and required ones that did not pass."""
        return [c.name for c in self.checks if c.status == FAIL or (c.name in self.required and not c.passed)]

    @property
    def not_applicable(self) -> list[str]:
        """Names of the checks whose comparison said nothing (never counted as passed)."""
        return [c.name for c in self.checks if c.status == NOT_APPLICABLE]

    @property
    def warnings(self) -> list[str]:
        """The checks' warnings, in check order (a warning never fails the gate by itself)."""
        return [c.warning for c in self.checks if c.warning]

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping (for JSON); each check also carries ``passed`` (its status is ``pass``)."""
        return {
            "passed": self.passed,
            "checks": [{**asdict(c), "passed": c.passed} for c in self.checks],
            "warnings": self.warnings,
            "failed": self.failed,
            "not_applicable": self.not_applicable,
            "required": list(self.required),
        }


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
        return Check(name, None, threshold, FAIL, f"{missing}; cannot check {what}")
    passed = value <= threshold
    relation = "≤" if passed else ">"
    verdict = "ok" if passed else "too high"
    reason = f"{what} {value:.6g} {relation} {threshold:.6g}: {verdict}"
    return Check(name, value, threshold, PASS if passed else FAIL, reason)


def _at_least(name: str, value: float | None, threshold: float, missing: str, what: str) -> Check:
    if value is None:
        return Check(name, None, threshold, FAIL, f"{missing}; cannot check {what}")
    passed = value >= threshold
    relation = "≥" if passed else "<"
    verdict = "ok" if passed else "too low"
    reason = f"{what} {value:.6g} {relation} {threshold:.6g}: {verdict}"
    return Check(name, value, threshold, PASS if passed else FAIL, reason)


def _disabled(name: str, setting: str) -> Check:
    return Check(name, None, None, OFF, f"disabled ({setting} is null)")


def _not_applicable(name: str, threshold: float | None, why: str, value: float | None = None) -> Check:
    return Check(name, value, threshold, NOT_APPLICABLE, why)


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
        return _not_applicable(
            "int8_perplexity_delta",
            cfg.max_int8_perplexity_delta,
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
    if cfg.min_student_exact_match == 0:
        value, _ = _number(results, STUDENT, "exact_match")
        why = "min_student_exact_match is 0, which every exact match meets (set it above 0 to check)"
        return _not_applicable(name, 0.0, why, value)
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


def _against_production(
    results: Mapping[str, Any], model: str, key: str
) -> tuple[float | None, float | None, str, str | None]:
    """``(value, production's value, why either is missing, production version)`` of ``model``'s ``key``.

    Without a production release the version is ``None`` and the reason says why there is none.
    """
    prod, prod_missing, version = _production(results, f"{model}_{key}")
    if version is None:
        return None, None, prod_missing, None
    value, missing = _number(results, model, key)
    return value, prod, "; ".join(m for m in (missing, prod_missing) if m), version


def _no_production_yet(name: str, threshold: float, reason: str) -> Check:
    return _not_applicable(name, threshold, f"{reason}: nothing to compare with (first release)")


def check_bits_per_byte_vs_production(cfg: GateConfig, results: Mapping[str, Any]) -> Check:
    """Student bits per byte is at most production's times ``1 + max_bits_per_byte_regression``.

    The value is the relative regression ``(bpb - bpb_production) / bpb_production``; better is negative.
    """
    name = "bits_per_byte_vs_production"
    margin = cfg.max_bits_per_byte_regression
    if margin is None:
        return _disabled(name, "max_bits_per_byte_regression")
    cand, prod, missing, version = _against_production(results, STUDENT, "bits_per_byte")
    if version is None:
        return _no_production_yet(name, margin, missing)
    problems = [missing] if missing else []
    value = _relative(cand, prod, problems, f"production {version} student_bits_per_byte")
    what = f"student bits/byte regression vs production {version}"
    return _at_most(name, value, margin, "; ".join(problems), what)


def check_exact_match_vs_production(cfg: GateConfig, results: Mapping[str, Any]) -> Check:
    """Student exact match is at most ``max_exact_match_regression`` below production's (absolute)."""
    name = "exact_match_vs_production"
    margin = cfg.max_exact_match_regression
    if margin is None:
        return _disabled(name, "max_exact_match_regression")
    cand, prod, missing, version = _against_production(results, STUDENT, "exact_match")
    if version is None:
        return _no_production_yet(name, margin, missing)
    if prod == 0 and cand is not None:
        return _not_applicable(name, margin, f"production {version} exact match is 0: there is none to lose")
    value = prod - cand if cand is not None and prod is not None else None
    what = f"student exact-match drop vs production {version}"
    return _at_most(name, value, margin, missing, what)


def _relative(value: float | None, reference: float | None, missing: list[str], what: str) -> float | None:
    """``(value − reference) / reference``, or ``None`` with the reason appended to ``missing``."""
    if value is None or reference is None:
        return None
    if reference <= 0:
        missing.append(f"{what} is {reference}, not positive")
        return None
    return (value - reference) / reference


def _pair(results: Mapping[str, Any], model: str, reference: str, key: str) -> tuple[float | None, float | None, str]:
    value, missing_value = _number(results, model, key)
    ref, missing_ref = _number(results, reference, key)
    return value, ref, "; ".join(m for m in (missing_value, missing_ref) if m)


def check_answer_loss_vs_teacher(cfg: GateConfig, results: Mapping[str, Any]) -> Check:
    """The served model's held-out answer loss is at most the teacher's times ``1 + max_answer_loss_increase``.

    The value is the relative increase ``(loss_served − loss_teacher) / loss_teacher``. The served model is
    what users get (an INT8 student, usually); a served model without an answer loss is checked as the student.
    """
    name = "answer_loss_vs_teacher"
    if cfg.max_answer_loss_increase is None:
        return _disabled(name, "max_answer_loss_increase")
    served = results.get("served_model")
    entry = (results.get("models") or {}).get(served) or {} if served else {}
    model = served if entry.get("answer_loss") is not None else STUDENT
    value, teacher, missing = _pair(results, model, TEACHER, "answer_loss")
    problems = [missing] if missing else []
    increase = _relative(value, teacher, problems, f"{TEACHER}.answer_loss")
    what = f"{model} held-out answer loss increase vs teacher"
    return _at_most(name, increase, cfg.max_answer_loss_increase, "; ".join(problems), what)


def check_f1_vs_teacher(cfg: GateConfig, results: Mapping[str, Any]) -> Check:
    """The student's held-out F1 is at most ``max_f1_drop`` (a fraction of the teacher's F1) below the teacher's.

    The value is ``(f1_teacher − f1_student) / f1_teacher``; a teacher with F1 0 leaves nothing to lose (n/a).
    """
    name = "f1_vs_teacher"
    if cfg.max_f1_drop is None:
        return _disabled(name, "max_f1_drop")
    student, teacher, missing = _pair(results, STUDENT, TEACHER, "f1")
    if teacher == 0:
        return _not_applicable(name, cfg.max_f1_drop, "the teacher's F1 is 0: there is no F1 to lose")
    drop = None
    if student is not None and teacher is not None:
        drop = (teacher - student) / teacher
    return _at_most(name, drop, cfg.max_f1_drop, missing, "student F1 drop vs teacher (fraction of teacher F1)")


def empty_answers_model(results: Mapping[str, Any]) -> str:
    """Whose empty answers count: the served model's where it generated (evaluate decodes its ONNX KV-cache
    graph as ``lmforge serve`` does), else its student's."""
    served = results.get("served_model")
    entry = (results.get("models") or {}).get(served) if served else None
    return served if entry and entry.get("empty_answer_fraction") is not None else STUDENT


def check_empty_answers(cfg: GateConfig, results: Mapping[str, Any]) -> Check:
    """At most ``max_empty_answers`` of the served model's answers to held-out prompts are empty (its student's
    where the served model could not generate)."""
    name = "served_empty_answers"
    if cfg.max_empty_answers is None:
        return _disabled(name, "max_empty_answers")
    model = empty_answers_model(results)
    value, missing = _number(results, model, "empty_answer_fraction")
    return _at_most(name, value, cfg.max_empty_answers, missing, f"share of empty {model} answers")


def _forgetting(name: str, model: str, limit: float | None, setting: str, results: Mapping[str, Any]) -> Check:
    if limit is None:
        return _disabled(name, setting)
    if BASE not in (results.get("models") or {}):
        return _not_applicable(name, limit, "no base model evaluated: nothing to measure forgetting against")
    value, base, missing = _pair(results, model, BASE, "bits_per_byte")
    problems = [missing] if missing else []
    increase = _relative(value, base, problems, f"{BASE}.bits_per_byte")
    what = f"{model} bits/byte increase vs base on held-out corpus text"
    return _at_most(name, increase, limit, "; ".join(problems), what)


def check_teacher_forgetting(cfg: GateConfig, results: Mapping[str, Any]) -> Check:
    """Teacher bits per byte is at most the base model's times ``1 + max_teacher_forgetting``."""
    return _forgetting("teacher_forgetting", TEACHER, cfg.max_teacher_forgetting, "max_teacher_forgetting", results)


def check_student_forgetting(cfg: GateConfig, results: Mapping[str, Any]) -> Check:
    """Student bits per byte is at most the base model's times ``1 + max_student_forgetting``."""
    return _forgetting("student_forgetting", STUDENT, cfg.max_student_forgetting, "max_student_forgetting", results)


def retention(results: Mapping[str, Any]) -> dict[str, float] | None:
    """Documents and bytes kept by cleaning, as counts and fractions; ``None`` without cleaning statistics."""
    metrics = ((results.get("data") or {}).get("clean") or {}).get("metrics") or {}
    counts = {k: metrics.get(k) for k in ("docs_in", "docs_out", "bytes_in", "bytes_out")}
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in counts.values()):
        return None
    if not counts["docs_in"] or not counts["bytes_in"]:
        return None
    return {
        **{k: float(v) for k, v in counts.items()},
        "documents": counts["docs_out"] / counts["docs_in"],
        "bytes": counts["bytes_out"] / counts["bytes_in"],
    }


def check_data_retention(cfg: GateConfig, results: Mapping[str, Any]) -> Check:
    """The share of documents and of bytes that cleaning kept (the lower of the two) is at least ``min_retention``;
    below ``retention_warning`` the check warns. Without cleaning statistics, or with ``min_retention`` null, n/a."""
    name = "data_retention"
    kept = retention(results)
    if kept is None:
        return _not_applicable(name, cfg.min_retention, "no cleaning statistics given: retention not measured")
    value = min(kept["documents"], kept["bytes"])
    figures = (
        f"cleaning kept {kept['docs_out']:.0f} of {kept['docs_in']:.0f} documents ({kept['documents']:.1%}) and "
        f"{kept['bytes']:.1%} of the bytes"
    )
    warning = None
    if cfg.retention_warning is not None and value < cfg.retention_warning:
        warning = f"{figures}: below the {cfg.retention_warning:.0%} warning level; check the cleaning rules"
    if cfg.min_retention is None:
        why = f"{figures}; no failing threshold (min_retention is null)"
        return Check(name, value, None, NOT_APPLICABLE, why, warning)
    passed = value >= cfg.min_retention
    relation = "≥" if passed else "<"
    reason = f"{figures}: {value:.1%} {relation} {cfg.min_retention:.1%}: {'ok' if passed else 'too low'}"
    return Check(name, value, cfg.min_retention, PASS if passed else FAIL, reason, warning)


def _lower_is_better(results: Mapping[str, Any], key: str) -> bool:
    """Whether the harness says ``harness.<task>.<metric>`` is better lower (perplexity, say)."""
    _, task, metric = key.split(".", 2)
    task_info = ((results.get("harness") or {}).get("tasks") or {}).get(task) or {}
    return (task_info.get("higher_is_better") or {}).get(metric) is False


def _nothing_scored(results: Mapping[str, Any], models: tuple[str, ...], key: str) -> str | None:
    """Why ``harness.<task>.<metric>`` says nothing for one of ``models``: its context fit none of the task's items."""
    _, task, _ = key.split(".", 2)
    harness = results.get("harness") or {}
    notes = [f"{model} {task}: {note}" for model in models if (note := all_skipped(harness, model, task))]
    return "; ".join(notes) + ": nothing to check" if notes else None


def _when_scored(check: Check, unscored: str | None) -> Check:
    """``check``, or n/a when no item of its harness task fit the model's context (``unscored`` says why)."""
    return _not_applicable(check.name, check.threshold, unscored) if unscored else check


def _direction(lower: bool) -> tuple[float, str]:
    """The sign that turns a metric's fall into a positive drop, and the drop's name: for a lower-is-better
    metric, a rise."""
    return (-1.0, "rise") if lower else (1.0, "drop")


def _harness_floor(results: Mapping[str, Any], key: str, limits: HarnessCheck, lower: bool) -> Check:
    """``<key>``: the model's metric is at least ``limits.min`` (at most, for a lower-is-better metric)."""
    value, missing = _number(results, limits.model, key)
    bound = _at_most if lower else _at_least
    check = bound(key, value, limits.min, missing, f"{limits.model} {key}")
    return _when_scored(check, _nothing_scored(results, (limits.model,), key))


def _harness_vs_teacher(results: Mapping[str, Any], key: str, limits: HarnessCheck, lower: bool) -> Check:
    """``<key>_vs_teacher``: the metric's drop below the teacher's, as a fraction of the teacher's."""
    value, teacher, missing = _pair(results, limits.model, TEACHER, key)
    problems = [missing] if missing else []
    change = _relative(value, teacher, problems, f"{TEACHER}.{key}")
    sign, drop_name = _direction(lower)
    drop = None if change is None else -sign * change
    what = f"{limits.model} {key} {drop_name} vs teacher (fraction of teacher's)"
    check = _at_most(f"{key}_vs_teacher", drop, limits.max_drop_vs_teacher, "; ".join(problems), what)
    return _when_scored(check, _nothing_scored(results, (limits.model, TEACHER), key))


def _harness_vs_production(results: Mapping[str, Any], key: str, limits: HarnessCheck, lower: bool) -> Check:
    """``<key>_vs_production``: the metric's drop below the production release's (absolute)."""
    name, model = f"{key}_vs_production", limits.model
    value, prod, missing, version = _against_production(results, model, key)
    if version is None:
        return _no_production_yet(name, limits.max_drop_vs_production, missing)
    sign, drop_name = _direction(lower)
    drop = sign * (prod - value) if value is not None and prod is not None else None
    what = f"{model} {key} {drop_name} vs production {version}"
    check = _at_most(name, drop, limits.max_drop_vs_production, missing, what)
    return _when_scored(check, _nothing_scored(results, (model,), key))


def check_harness(cfg: GateConfig, results: Mapping[str, Any]) -> list[Check]:
    """``gate.harness``'s checks on lm-evaluation-harness metrics (``results["models"][model]["harness.<task>.
    <metric>"]``), in the gate's forms: a floor (``<key>``), a drop against the teacher as a fraction of the
    teacher's value (``<key>_vs_teacher``) and a drop against production, absolute (``<key>_vs_production``).

    For a metric the harness marks lower-is-better the floor is a ceiling and a drop is a rise. A check on a task
    that skipped every item for the model (or the teacher) is n/a: no item fit the model's context.
    """
    checks = []
    for key, limits in cfg.harness.items():
        lower = _lower_is_better(results, key)
        if limits.min is not None:
            checks.append(_harness_floor(results, key, limits, lower))
        if limits.max_drop_vs_teacher is not None:
            checks.append(_harness_vs_teacher(results, key, limits, lower))
        if limits.max_drop_vs_production is not None:
            checks.append(_harness_vs_production(results, key, limits, lower))
    return checks


CHECKS = (
    check_student_perplexity,
    check_int8_delta,
    check_served_latency,
    check_student_exact_match,
    check_answer_loss_vs_teacher,
    check_f1_vs_teacher,
    check_empty_answers,
    check_teacher_forgetting,
    check_student_forgetting,
    check_data_retention,
    check_bits_per_byte_vs_production,
    check_exact_match_vs_production,
)
"""Every check, in report order."""


def low_confidence(results: Mapping[str, Any], data: str) -> str | None:
    """``"low confidence: ..."`` when the held-out ``data`` (``text`` or ``qa``) is below its configured minimum."""
    entry = (results.get("confidence") or {}).get(data) or {}
    return str(entry["note"]) if entry.get("low") else None


def _on_enough_data(check: Check, results: Mapping[str, Any]) -> Check:
    """A passing check whose value rests on a held-out set below its minimum becomes n/a (a failing one fails)."""
    data = DATA_OF_CHECK.get(check.name)
    note = low_confidence(results, data) if data else None
    if note is None or check.status not in (PASS, FAIL):
        return check
    if check.status == FAIL:
        return Check(check.name, check.value, check.threshold, FAIL, f"{check.reason} ({note})", check.warning)
    why = f"{note}, too little to count a pass ({check.reason})"
    return Check(check.name, check.value, check.threshold, NOT_APPLICABLE, why, check.warning)


def check_gate(cfg: GateConfig, results: Mapping[str, Any]) -> GateDecision:
    """Run every check; the gate passes when none fails and every one in ``cfg.required`` passes."""
    checks = [_on_enough_data(check(cfg, results), results) for check in CHECKS] + check_harness(cfg, results)
    required = tuple(cfg.required)
    passed = all(c.status != FAIL and (c.passed or c.name not in required) for c in checks)
    return GateDecision(passed=passed, checks=checks, required=required)


def headline(results: Mapping[str, Any]) -> dict[str, Any]:
    """The figures a run ends with: the served model's empty answers and its answer loss against the teacher's (its
    student's where it has none), the teacher's bits per byte against the base's, data retention, the gate's check
    counts by status (and which were n/a), the held-out sets' low-confidence notes and the gate's warnings.

    Ratios are ``value / reference`` (1.0: equal); a figure that cannot be computed is ``None``.
    """
    models = results.get("models") or {}
    served = results.get("served_model")

    def figure(model: str | None, key: str) -> float | None:
        value = (models.get(model) or {}).get(key) if model else None
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    def ratio(value: float | None, reference: float | None) -> float | None:
        return value / reference if value is not None and reference else None

    served_loss = figure(served, "answer_loss")
    loss_model = served if served_loss is not None else STUDENT
    empty_model = empty_answers_model(results)
    kept = retention(results)
    checks = (results.get("gate") or {}).get("checks") or []
    statuses = [check_status(c) for c in checks]
    return {
        "served_model": served,
        "empty_answer_model": empty_model,
        "empty_answer_fraction": figure(empty_model, "empty_answer_fraction"),
        "answer_loss_model": loss_model,
        "answer_loss_vs_teacher": ratio(figure(loss_model, "answer_loss"), figure(TEACHER, "answer_loss")),
        "teacher_bits_per_byte_vs_base": ratio(figure(TEACHER, "bits_per_byte"), figure(BASE, "bits_per_byte")),
        "retention_documents": kept["documents"] if kept else None,
        "retention_bytes": kept["bytes"] if kept else None,
        "checks": {status: statuses.count(status) for status in _MARKS},
        "not_applicable": [f"{c.get('name')}: {c.get('reason')}" for c in checks if check_status(c) == NOT_APPLICABLE],
        "low_confidence": [
            f"{what}: {note}"
            for what, data in (("held-out text", TEXT), ("held-out Q&A", QA))
            if (note := low_confidence(results, data))
        ],
        "warnings": list((results.get("gate") or {}).get("warnings") or []),
    }


def headline_lines(head: Mapping[str, Any]) -> list[str]:
    """The headline as short lines for a log, a report summary or the CLI's last lines."""

    def pct(value: Any) -> str:
        return "n/a" if value is None else f"{value:.0%}"

    def times(value: Any) -> str:
        return "n/a" if value is None else f"{value:.3f}x"

    lines = [
        f"served model {head.get('served_model') or 'none'}: {pct(head.get('empty_answer_fraction'))} of held-out "
        f"prompts answered with an empty string ({head.get('empty_answer_model')}), answer loss "
        f"{times(head.get('answer_loss_vs_teacher'))} "
        f"the teacher's ({head.get('answer_loss_model')})",
        f"teacher bits/byte on held-out corpus text: {times(head.get('teacher_bits_per_byte_vs_base'))} the base "
        "model's",
        f"data retention: cleaning kept {pct(head.get('retention_documents'))} of documents, "
        f"{pct(head.get('retention_bytes'))} of bytes",
    ]
    counts = head.get("checks") or {}
    if counts:
        lines.append(
            f"gate checks: {counts.get(PASS, 0)} PASS, {counts.get(FAIL, 0)} FAIL, {counts.get(NOT_APPLICABLE, 0)} n/a "
            f"(not counted as passed), {counts.get(OFF, 0)} off"
        )
    lines += [f"n/a {item}" for item in head.get("not_applicable") or []]
    lines += [f"WARNING: {item}" for item in head.get("low_confidence") or []]
    return lines + [f"WARNING: {w}" for w in head.get("warnings") or []]
