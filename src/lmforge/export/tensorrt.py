"""The ``build_tensorrt`` stage: a Q/DQ INT8 ONNX model directory to a TensorRT engine.

Output directory: ``engine.plan`` + ``build_record.json`` (TensorRT version, GPU, precision, profiles,
build time, smoke-test result) + ``manifest.json``. Without the ``tensorrt`` package or a CUDA GPU the
stage writes ``status.json`` ``{"status": "skipped", "reason": ...}`` and a manifest instead; it never
writes a placeholder engine.

Only :func:`_build_engine` and :func:`_run_engine` touch ``tensorrt``; everything else is plain Python.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from lmforge.artifacts import input_record, staged_output, write_manifest
from lmforge.config import TensorRTConfig
from lmforge.errors import InputDataError, LmforgeError
from lmforge.export.ort import OrtCausalLM, resolve_model_file
from lmforge.results import StageResult

log = logging.getLogger("lmforge.export")

KIND = "tensorrt-engine"
ENGINE_FILE = "engine.plan"
BUILD_RECORD = "build_record.json"
STATUS_FILE = "status.json"
# Inputs whose shape is [batch, seq]; a KV-cache export will add rules for its past/present tensors.
BATCH_SEQ_INPUTS = ("input_ids", "attention_mask")

Shape = tuple[int, ...]


class TensorRTBuildError(LmforgeError):
    """TensorRT could not parse the ONNX model or build an engine from it."""


def optimization_profiles(cfg: TensorRTConfig, input_names: Sequence[str]) -> dict[str, tuple[Shape, Shape, Shape]]:
    """``{input name: (min, opt, max) shape}`` of the single optimization profile, from ``cfg``."""
    profiles = {}
    for name in input_names:
        if name not in BATCH_SEQ_INPUTS:
            raise InputDataError(
                f"no optimization-profile rule for graph input {name!r}; known inputs: {BATCH_SEQ_INPUTS}"
            )
        profiles[name] = (
            (cfg.min_batch, cfg.min_seq),
            (cfg.opt_batch, cfg.opt_seq),
            (cfg.max_batch, cfg.max_seq),
        )
    return profiles


def unavailable_reason() -> str | None:
    """Why an engine cannot be built here (no ``tensorrt`` package, no CUDA GPU), or ``None``."""
    if importlib.util.find_spec("tensorrt") is None:
        return "the tensorrt Python package is not installed (use the TensorRT image)"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    return None


def graph_inputs(model_file: Path) -> list[str]:
    """Names of the ONNX graph's runtime inputs (initializers excluded)."""
    model = onnx.load(str(model_file), load_external_data=False)
    initializers = {i.name for i in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in initializers]


def count_qdq_nodes(model_file: Path) -> int:
    """Number of QuantizeLinear / DequantizeLinear nodes in the main graph."""
    model = onnx.load(str(model_file), load_external_data=False)
    return sum(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node)


def build_record(
    cfg: TensorRTConfig,
    profiles: dict[str, tuple[Shape, Shape, Shape]],
    *,
    tensorrt_version: str,
    gpu_name: str,
    build_seconds: float,
    strongly_typed: bool,
    timing_cache: dict[str, Any] | None,
    smoke: dict[str, Any] | None,
) -> dict[str, Any]:
    """The JSON build record stored next to the engine."""
    return {
        "tensorrt_version": tensorrt_version,
        "gpu": gpu_name,
        "precision": cfg.precision,
        "strongly_typed": strongly_typed,
        "workspace_gib": cfg.workspace_gib,
        "profiles": [{name: {"min": list(s[0]), "opt": list(s[1]), "max": list(s[2])} for name, s in profiles.items()}],
        "build_seconds": build_seconds,
        "timing_cache": timing_cache,
        "smoke_test": smoke,
    }


def write_status(root: Path, status: str, reason: str) -> dict[str, str]:
    """Write ``status.json`` into ``root`` and return its content."""
    content = {"status": status, "reason": reason}
    (root / STATUS_FILE).write_text(json.dumps(content, indent=2), encoding="utf-8")
    return content


# --- the only code that imports tensorrt -------------------------------------------------------------


def _build_engine(
    model_file: Path,
    profiles: dict[str, tuple[Shape, Shape, Shape]],
    *,
    precision: str,
    workspace_bytes: int,
    timing_cache: Path | None,
) -> tuple[bytes, dict[str, Any]]:
    """Parse ``model_file``, build and serialize an engine; return it with facts for the build record."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    # Q/DQ and FP32 graphs carry their own types; strongly typed keeps TensorRT to them. FP16 from an
    # FP32 graph needs the (weakly typed) FP16 builder flag instead.
    strongly_typed = precision != "fp16"
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly_typed else 0
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(model_file)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise TensorRTBuildError(f"TensorRT could not parse {model_file}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profiles.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    cache_info = None
    if timing_cache is not None:
        existing = timing_cache.read_bytes() if timing_cache.is_file() else b""
        config.set_timing_cache(config.create_timing_cache(existing), ignore_mismatch=False)
        cache_info = {"path": str(timing_cache), "reused": bool(existing)}
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise TensorRTBuildError(f"TensorRT failed to build an engine from {model_file} (see the log above)")
    if timing_cache is not None:
        timing_cache.parent.mkdir(parents=True, exist_ok=True)
        partial = timing_cache.with_name(timing_cache.name + ".partial")
        partial.write_bytes(memoryview(config.get_timing_cache().serialize()))
        os.replace(partial, timing_cache)
    return bytes(memoryview(plan)), {
        "tensorrt_version": trt.__version__,
        "strongly_typed": strongly_typed,
        "timing_cache": cache_info,
    }


def _run_engine(plan: bytes, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """Deserialize ``plan`` and return the ``logits`` output for ``feeds`` (CUDA buffers via torch)."""
    import tensorrt as trt

    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan)
    context = engine.create_execution_context()
    buffers = {}
    for name, array in feeds.items():
        buffers[name] = torch.from_numpy(array).cuda().contiguous()
        context.set_input_shape(name, tuple(array.shape))
    out_shape = tuple(context.get_tensor_shape("logits"))
    buffers["logits"] = torch.empty(out_shape, dtype=torch.float32, device="cuda")
    for name, tensor in buffers.items():
        context.set_tensor_address(name, tensor.data_ptr())
    stream = torch.cuda.Stream()
    if not context.execute_async_v3(stream.cuda_stream):
        raise TensorRTBuildError("TensorRT engine failed to execute the smoke-test batch")
    stream.synchronize()
    return buffers["logits"].cpu().numpy()


# -----------------------------------------------------------------------------------------------------


def _smoke_test(plan: bytes, model_file: Path, cfg: TensorRTConfig, vocab_size: int) -> dict[str, Any]:
    """Compare engine logits with ONNX Runtime on one deterministic batch at the profile's opt shape."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab_size, size=(cfg.opt_batch, cfg.opt_seq), dtype=np.int64)
    mask = np.ones_like(ids)
    expected = OrtCausalLM(model_file).logits(ids, mask)
    actual = _run_engine(plan, {"input_ids": ids, "attention_mask": mask})
    if actual.shape != expected.shape or not np.isfinite(actual).all():
        raise TensorRTBuildError(f"engine logits shape {actual.shape} or values are wrong (ORT {expected.shape})")
    agree = float(np.mean(actual.argmax(-1) == expected.argmax(-1)))
    return {
        "shape": list(ids.shape),
        "max_abs_diff_vs_ort": float(np.max(np.abs(actual - expected))),
        "top1_agreement_vs_ort": agree,
    }


def run(
    cfg: TensorRTConfig,
    qdq_dir: str | Path,
    output_dir: str | Path,
    *,
    timing_cache: str | Path | None = None,
) -> StageResult:
    """Build a TensorRT engine from the ONNX model in ``qdq_dir``, or record why it was skipped.

    Args:
        timing_cache: a timing-cache file read before and rewritten after the build, so that later builds
            on the same GPU and TensorRT version reuse kernel timings.
    """
    qdq_dir = Path(qdq_dir)
    model_file = resolve_model_file(qdq_dir)
    source = input_record(qdq_dir)
    profiles = optimization_profiles(cfg, graph_inputs(model_file))
    if cfg.precision == "int8" and count_qdq_nodes(model_file) == 0:
        raise InputDataError(f"{model_file}: precision int8 needs a Q/DQ model, but the graph has no Q/DQ nodes")
    inputs = {"onnx_model": source}

    reason = unavailable_reason()
    if reason is not None:
        log.warning("build_tensorrt skipped: %s", reason)
        metrics = {"built": 0.0}
        with staged_output(output_dir) as out:
            status = write_status(out, "skipped", reason)
            write_manifest(out, KIND, inputs=inputs, config=cfg.model_dump(), metrics=metrics, extra=status)
        return StageResult(metrics=metrics, summary=dict(status))

    start = time.perf_counter()
    plan, facts = _build_engine(
        model_file,
        profiles,
        precision=cfg.precision,
        workspace_bytes=int(cfg.workspace_gib * (1 << 30)),
        timing_cache=Path(timing_cache) if timing_cache is not None else None,
    )
    build_seconds = time.perf_counter() - start
    vocab_size = int(json.loads((qdq_dir / "config.json").read_text(encoding="utf-8"))["vocab_size"])
    smoke = _smoke_test(plan, model_file, cfg, vocab_size)
    record = build_record(
        cfg,
        profiles,
        tensorrt_version=facts["tensorrt_version"],
        gpu_name=torch.cuda.get_device_name(0),
        build_seconds=build_seconds,
        strongly_typed=facts["strongly_typed"],
        timing_cache=facts["timing_cache"],
        smoke=smoke,
    )
    metrics = {
        "built": 1.0,
        "build_seconds": build_seconds,
        "engine_size_mb": len(plan) / 1e6,
        "smoke_max_abs_diff": smoke["max_abs_diff_vs_ort"],
        "smoke_top1_agreement": smoke["top1_agreement_vs_ort"],
    }
    with staged_output(output_dir) as out:
        (out / ENGINE_FILE).write_bytes(plan)
        (out / BUILD_RECORD).write_text(json.dumps(record, indent=2), encoding="utf-8")
        status = write_status(out, "built", f"TensorRT {record['tensorrt_version']} on {record['gpu']}")
        write_manifest(out, KIND, inputs=inputs, config=cfg.model_dump(), metrics=metrics, extra=status)
    log.info("built TensorRT engine %s (%.1f MB, %.1f s)", output_dir, metrics["engine_size_mb"], build_seconds)
    return StageResult(metrics=metrics, summary={**status, "build_record": record})
