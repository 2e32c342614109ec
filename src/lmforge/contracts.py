"""The files one stage writes and another reads, declared once.

A stage reads another stage's output only through what is here (and the format modules of :mod:`lmforge.formats`,
:mod:`lmforge.data.qa`, :mod:`lmforge.data.tokenizer`), never by importing the other stage's module. Each record
says who writes it and who reads it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmforge.artifacts import read_json_file, read_manifest
from lmforge.errors import InputDataError

log = logging.getLogger("lmforge.contracts")

# --- a model directory's config.json (Hugging Face format): quantize_int8 and evaluate bound their windows by the
# --- context it declares.

CONTEXT_KEYS = ("n_positions", "max_position_embeddings")  # GPT-2's, Llama's


def max_positions(config: Mapping[str, Any]) -> int | None:
    """The context length a model's ``config.json`` declares (the first integer of :data:`CONTEXT_KEYS`)."""
    for key in CONTEXT_KEYS:
        if isinstance(config.get(key), int):
            return int(config[key])
    return None


# --- the INT8 accuracy gate: quantize_int8 writes it into each INT8 model's manifest; build_tensorrt, evaluate
# --- and promote read it back.

GATE_KEY = "accuracy_gate"


def gate_decision(fp32_ppl: float, int8_ppl: float, threshold: float) -> dict[str, Any]:
    """Accept an INT8 model when ``(int8 - fp32) / fp32 <= threshold``; the reason says which way and why."""
    delta = (int8_ppl - fp32_ppl) / fp32_ppl if fp32_ppl > 0 else math.inf
    accepted = math.isfinite(int8_ppl) and math.isfinite(delta) and delta <= threshold
    relation = "<=" if accepted else ">"
    reason = (
        f"held-out perplexity {int8_ppl:.6g} vs FP32 {fp32_ppl:.6g}: delta {delta:+.2%} {relation} "
        f"max_perplexity_delta {threshold:+.2%}"
    )
    if not math.isfinite(int8_ppl):
        reason = f"held-out perplexity is not finite ({int8_ppl}); FP32 {fp32_ppl:.6g}"
    return {
        "accepted": bool(accepted),
        "reason": ("accepted: " if accepted else "rejected: ") + reason,
        "fp32_perplexity": fp32_ppl,
        "perplexity": int8_ppl,
        "perplexity_delta": delta,
        "max_perplexity_delta": threshold,
    }


def gate_result(model_dir: str | Path) -> dict[str, Any]:
    """The accuracy-gate record of an ONNX model directory; an unquantized model is always accepted."""
    manifest = read_manifest(model_dir)
    if manifest.get("quantization", "none") == "none":
        return {"accepted": True, "reason": "FP32 model: not quantized, nothing to gate"}
    gate = manifest.get(GATE_KEY)
    if not isinstance(gate, dict) or not isinstance(gate.get("accepted"), bool):
        return {"accepted": False, "reason": f"{model_dir}: manifest has no accuracy-gate result"}
    return gate


# --- the TensorRT engine's status: build_tensorrt writes it (built, skipped or failed, with the reason); evaluate
# --- and serving read it.

ENGINE_STATUS_FILE = "status.json"
ENGINE_STATES = ("built", "skipped", "failed")


def read_engine_status(engine_dir: Path | None) -> dict[str, Any]:
    """The TensorRT stage's ``status.json`` plus the engine size; ``absent`` when no directory is given."""
    if engine_dir is None:
        return {"status": "absent", "reason": "no TensorRT engine directory given"}
    path = Path(engine_dir, ENGINE_STATUS_FILE)
    if not path.is_file():
        raise InputDataError(f"TensorRT engine directory {engine_dir}: no {ENGINE_STATUS_FILE}")
    status = read_json_file(path)
    if not isinstance(status, dict) or status.get("status") not in ENGINE_STATES:
        raise InputDataError(f"{path}: 'status' must be one of {', '.join(ENGINE_STATES)}")
    plans = list(Path(engine_dir).glob("*.plan"))
    if plans:
        status.setdefault("size_bytes", sum(p.stat().st_size for p in plans))
    return status


# --- the training history: pretrain, finetune_lora and distill write it next to the model they save
# --- (lmforge.model.build.save_model_dir); evaluate's report plots it.

HISTORY_FILE = "training_history.json"


def read_history(model_dir: str | Path) -> dict[str, Any] | None:
    """The ``training_history.json`` next to a trained model, or ``None`` when there is none."""
    path = Path(model_dir, HISTORY_FILE)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        # A broken history only costs a plot; the evaluation itself stays valid.
        log.warning("%s: not valid JSON (%s); no loss curves for it", path, exc.msg)
        return None
    return data if isinstance(data, dict) else None


# --- the evaluation: evaluate writes results.json (figures per model, the served model, the gate, the production
# --- baseline) with report.html and report.md; promote, the run summary and serving read results.json.

RESULTS_FILE = "results.json"
REPORT_HTML = "report.html"
REPORT_MD = "report.md"


def read_results(evaluation_dir: str | Path) -> dict[str, Any]:
    """``results.json`` of an evaluation directory.

    Raises:
        InputDataError: there is none.
    """
    path = Path(evaluation_dir, RESULTS_FILE)
    if not path.is_file():
        raise InputDataError(f"evaluation directory {evaluation_dir}: no {RESULTS_FILE}")
    return read_json_file(path)


# --- the served model: evaluate picks it (results.json "served_model"); promote releases it, serving serves it.

SERVED_PREFERENCE: tuple[str, ...] = ("tensorrt", "int8_dynamic", "int8_qdq", "onnx_fp32", "student")
"""The served model is the first of these with a measured batch-1 p99 latency."""


def served_model(models: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The first model of :data:`SERVED_PREFERENCE` with a measured batch-1 p99 latency that the quantize
    stage's accuracy gate did not reject (a rejected INT8 model falls back to the next, e.g. FP32)."""
    for name in SERVED_PREFERENCE:
        entry = models.get(name) or {}
        if entry.get("p99_ms") is not None and entry.get("accepted", True):
            return name
    return None


# --- the Q&A metrics' scales: evaluate writes them into results.json and the evaluation manifest's metrics
# --- (``<model>_<metric>``); the report, the model card and the KFP Metrics label them with their range.

QA_METRIC_SCALES: dict[str, tuple[int, int]] = {
    "exact_match": (0, 1),
    "f1": (0, 1),
    "bleu": (0, 100),
    "rouge_l": (0, 1),
}
"""Range of each Q&A metric: sacrebleu's corpus BLEU is 0–100, exact match, token F1 and ROUGE-L are fractions."""


def scale_text(metric: str, dash: str = "–") -> str:
    """``metric``'s range as text (``"0–100"``), or ``""`` when it is not a Q&A metric."""
    low, high = QA_METRIC_SCALES.get(metric, (None, None))
    return "" if low is None else f"{low}{dash}{high}"


def metric_name_with_scale(name: str) -> str:
    """A metric name as displays that show only names (KFP Metrics) give it: a Q&A metric, alone or as
    ``<model>_<metric>``, gets its range appended (``student_bleu`` → ``student_bleu_0to100``); others are unchanged.
    """
    for metric, (low, high) in QA_METRIC_SCALES.items():
        if name == metric or name.endswith(f"_{metric}"):
            return f"{name}_{low}to{high}"
    return name


# --- the Q&A split: finetune_lora holds out this fraction of prompts (by hash) and records the one it used in its
# --- manifest; evaluate and distill use the recorded one, this default when none is recorded.

QA_HELDOUT_FRACTION = 0.1


def split_bucket(doc_id: str) -> float:
    """A document's position in [0, 1), uniform over ids and stable across runs and machines: tokenize holds out
    the documents below its threshold, and whatever else needs the held-out documents finds them by it."""
    return int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big") / 2**64
