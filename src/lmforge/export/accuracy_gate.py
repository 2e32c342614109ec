"""The INT8 accuracy gate's record: decide it and read it back.

``quantize_int8`` writes the decision into each INT8 model's ``manifest.json`` under ``accuracy_gate``;
``build_tensorrt``, ``evaluate`` and ``promote`` read it back (without importing the quantizer).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lmforge.artifacts import read_manifest

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
