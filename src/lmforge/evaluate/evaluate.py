"""The ``evaluate`` stage: score every model on held-out tokens, time it, gate it, report it.

Every model (PyTorch teacher and student, ONNX FP32 / INT8 dynamic / INT8 Q/DQ) is scored with the
same perplexity and latency code through a logits adapter, on the same held-out tokens and the same
window length (the configured context, clamped to the smallest model's maximum positions so the
numbers stay comparable). The TensorRT engine is not run here; its ``status.json`` (built, or
skipped with a reason) is reported as is.
"""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.artifacts import input_record, staged_output, write_manifest
from lmforge.config import EvaluateConfig
from lmforge.data.shards import TokenShards
from lmforge.errors import InputDataError
from lmforge.evaluate.gate import check_gate
from lmforge.evaluate.latency import latency_profile
from lmforge.evaluate.perplexity import LogitsFn, onnx_logits_fn, perplexity, torch_logits_fn
from lmforge.evaluate.report import comparison_rows, html_report, markdown_summary, read_history
from lmforge.results import StageResult

log = logging.getLogger("lmforge.evaluate")

RESULTS_FILE = "results.json"
REPORT_HTML = "report.html"
REPORT_MD = "report.md"
ENGINE_STATUS = "status.json"
SERVED_PREFERENCE: tuple[str, ...] = ("tensorrt", "int8_dynamic", "int8_qdq", "onnx_fp32", "student")
"""The served model is the first of these with a measured batch-1 p99 latency."""
LATENCY_WARMUP = 3
_MB = 1e6


def _model_config(path: Path) -> dict[str, Any]:
    config = path / "config.json"
    if not config.is_file():
        raise InputDataError(f"model directory {path}: no config.json")
    try:
        return json.loads(config.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputDataError(f"{config}: not valid JSON ({exc.msg}, line {exc.lineno})") from exc


def _max_positions(config: Mapping[str, Any]) -> int | None:
    for key in ("n_positions", "max_position_embeddings"):
        if isinstance(config.get(key), int):
            return int(config[key])
    return None


def _check_vocab(name: str, config: Mapping[str, Any], tokens: np.ndarray) -> None:
    vocab = config.get("vocab_size")
    top = int(tokens.max())
    if isinstance(vocab, int) and top >= vocab:
        raise InputDataError(
            f"model {name!r} has vocab_size {vocab} but the held-out tokens contain id {top}; "
            "it was trained with a different tokenizer than the token shards"
        )


def _score(
    name: str, logits_fn: LogitsFn, size_bytes: int, tokens: np.ndarray, *, context: int, cfg: EvaluateConfig
) -> dict[str, Any]:
    ppl = perplexity(logits_fn, tokens, context=context)
    latency = latency_profile(logits_fn, tokens, context=context, runs=cfg.latency_runs, warmup=LATENCY_WARMUP)
    b1 = latency[1]
    log.info(
        "%s: perplexity %.4g over %d tokens, %.2f MB, p50 %.2f ms, p99 %.2f ms (batch 1)",
        name,
        ppl.perplexity,
        ppl.tokens,
        size_bytes / _MB,
        b1.p50_ms,
        b1.p99_ms,
    )
    return {
        **ppl.to_dict(),
        "size_bytes": int(size_bytes),
        "size_mb": size_bytes / _MB,
        "p50_ms": b1.p50_ms,
        "p99_ms": b1.p99_ms,
        "tokens_per_s": b1.tokens_per_s,
        "latency": {str(b): r.to_dict() for b, r in latency.items()},
    }


def _evaluate_torch(name: str, path: Path, tokens: np.ndarray, *, context: int, cfg: EvaluateConfig) -> dict:
    from lmforge.model.build import load_causal_lm

    model = load_causal_lm(path)
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    try:
        result = _score(name, torch_logits_fn(model), size, tokens, context=context, cfg=cfg)
    finally:
        del model
        gc.collect()
    return {"format": "pytorch", **result}


def _evaluate_onnx(name: str, path: Path, tokens: np.ndarray, *, context: int, cfg: EvaluateConfig) -> dict:
    from lmforge.export.ort import OrtCausalLM

    model = OrtCausalLM(path)
    try:
        result = _score(name, onnx_logits_fn(model), model.size_bytes, tokens, context=context, cfg=cfg)
    finally:
        del model
        gc.collect()
    return {"format": "onnx", **result}


def read_engine_status(engine_dir: Path | None) -> dict[str, Any]:
    """The TensorRT stage's ``status.json`` plus the engine size; ``absent`` when no directory is given."""
    if engine_dir is None:
        return {"status": "absent", "reason": "no TensorRT engine directory given"}
    path = Path(engine_dir, ENGINE_STATUS)
    if not path.is_file():
        raise InputDataError(f"TensorRT engine directory {engine_dir}: no {ENGINE_STATUS}")
    try:
        status = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputDataError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from exc
    if not isinstance(status, dict) or status.get("status") not in ("built", "skipped", "failed"):
        raise InputDataError(f"{path}: 'status' must be one of built, skipped, failed")
    plans = list(Path(engine_dir).glob("*.plan"))
    if plans:
        status.setdefault("size_bytes", sum(p.stat().st_size for p in plans))
    return status


def _engine_entry(status: Mapping[str, Any]) -> dict[str, Any] | None:
    """The engine's row in ``models`` when it was built: its size and any figures its stage measured."""
    if status.get("status") != "built":
        return None
    entry: dict[str, Any] = {"format": "tensorrt"}
    if isinstance(status.get("size_bytes"), int):
        entry["size_bytes"] = status["size_bytes"]
        entry["size_mb"] = status["size_bytes"] / _MB
    for key in ("perplexity", "bits_per_token", "p50_ms", "p99_ms", "tokens_per_s"):
        if isinstance(status.get(key), int | float):
            entry[key] = float(status[key])
    return entry


def served_model(models: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The first model of :data:`SERVED_PREFERENCE` with a measured batch-1 p99 latency."""
    for name in SERVED_PREFERENCE:
        if (models.get(name) or {}).get("p99_ms") is not None:
            return name
    return None


def run(
    cfg: EvaluateConfig,
    *,
    shards_dir: str | Path,
    models: Mapping[str, str | Path],
    onnx_models: Mapping[str, str | Path],
    engine_dir: str | Path | None,
    output_dir: str | Path,
) -> StageResult:
    """Evaluate every given model and write ``report.html``, ``report.md``, ``results.json``.

    Args:
        cfg: context, token budget, latency runs and the gate thresholds.
        shards_dir: token shards; the ``val`` split is the held-out text.
        models: Hugging Face model directories by name (``teacher``, ``student``).
        onnx_models: ONNX model directories by name (``onnx_fp32``, ``int8_dynamic``, ``int8_qdq``).
        engine_dir: the TensorRT stage's output (with ``status.json``), or ``None``.
        output_dir: where the evaluation artifact is committed (manifest kind ``evaluation``).
    """
    overlap = set(models) & set(onnx_models)
    if overlap:
        raise InputDataError(f"model names given both as PyTorch and ONNX models: {sorted(overlap)}")
    if not models and not onnx_models:
        raise InputDataError("evaluate: no models given")
    shards = TokenShards.open(shards_dir)
    tokens = np.asarray(shards.tokens("val")[: cfg.max_eval_tokens]).astype(np.int64)
    if tokens.size < 2:
        raise InputDataError(f"{shards_dir}: the val split has {tokens.size} token(s); need at least 2")

    trt = read_engine_status(Path(engine_dir) if engine_dir is not None else None)
    paths = {name: Path(p) for name, p in {**models, **onnx_models}.items()}
    configs = {name: _model_config(path) for name, path in paths.items()}
    for name, config in configs.items():
        _check_vocab(name, config, tokens)
    limits = [m for m in (_max_positions(c) for c in configs.values()) if m is not None]
    context = min([cfg.context, *limits])
    if context < cfg.context:
        log.warning("context %d exceeds a model's maximum positions; using %d for all models", cfg.context, context)

    evaluated: dict[str, dict[str, Any]] = {}
    for name, path in paths.items():
        log.info("evaluating %s (%s)", name, path)
        score_model = _evaluate_torch if name in models else _evaluate_onnx
        evaluated[name] = {"uri": str(path), **score_model(name, path, tokens, context=context, cfg=cfg)}

    if (engine := _engine_entry(trt)) is not None:
        evaluated["tensorrt"] = {"uri": str(engine_dir), **engine}

    results: dict[str, Any] = {
        "context": context,
        "eval_tokens": int(tokens.size),
        "latency_runs": cfg.latency_runs,
        "models": evaluated,
        "served_model": served_model(evaluated),
        "tensorrt": trt,
    }
    decision = check_gate(cfg.gate, results)
    results["gate"] = decision.to_dict()
    results["passed"] = decision.passed
    log.info("gate %s", "passed" if decision.passed else "failed")
    for check in decision.checks:
        log.info("  %s %s: %s", "PASS" if check.passed else "FAIL", check.name, check.reason)

    histories = {name: h for name, path in paths.items() if (h := read_history(path)) is not None}
    report = html_report(results, histories)
    metrics: dict[str, float] = {}
    for name, entry in evaluated.items():
        for key, metric in (("perplexity", "perplexity"), ("size_mb", "size_mb"), ("p99_ms", "p99_ms")):
            if entry.get(key) is not None:
                metrics[f"{name}_{metric}"] = float(entry[key])
    metrics["passed"] = 1.0 if decision.passed else 0.0

    inputs = {"shards": input_record(Path(shards_dir)), **{name: input_record(path) for name, path in paths.items()}}
    if engine_dir is not None:
        inputs["tensorrt"] = {"uri": str(engine_dir), "status": trt["status"]}
    with staged_output(output_dir) as scratch:
        (scratch / REPORT_HTML).write_text(report, encoding="utf-8")
        (scratch / REPORT_MD).write_text(markdown_summary(results), encoding="utf-8")
        (scratch / RESULTS_FILE).write_text(json.dumps(results, indent=2), encoding="utf-8")
        write_manifest(
            scratch,
            "evaluation",
            inputs=inputs,
            config=cfg.model_dump(mode="json"),
            metrics=metrics,
            extra={"passed": decision.passed},
        )
    table_rows = comparison_rows(results)
    return StageResult(
        metrics=metrics,
        html=report,
        summary={"passed": decision.passed, "checks": results["gate"]["checks"], "table": table_rows},
    )
