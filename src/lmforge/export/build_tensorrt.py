"""The ``build_tensorrt`` stage: a Q/DQ INT8 ONNX model directory to a TensorRT engine.

Output directory: ``engine.plan`` + ``build_record.json`` (TensorRT version, GPU, precision, profiles,
build time, timing cache, smoke-test result) + ``status.json`` + ``manifest.json``. Without the
``tensorrt`` package or a CUDA GPU the stage writes ``status.json`` ``{"status": "skipped", "reason": ...}``
and a manifest instead; it never writes a placeholder engine.

The graph is the cache graph ``model.onnx`` when the directory has one (``TensorRTConfig.graph``), with one
optimization profile over batch, new tokens and cached tokens; else ``decoder_model.onnx`` over batch and
sequence. The engine is built by the TensorRT Python API or by ``trtexec`` (``TensorRTConfig.builder``).

Only :func:`_build_engine`, :func:`_run_engine` and :func:`_run_trtexec` touch TensorRT; profile
derivation, the ``trtexec`` command line, its output parsing, the timing-cache record and the build
record are plain Python.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from lmforge.artifacts import input_record, staged_output, write_manifest
from lmforge.config import TensorRTConfig
from lmforge.contracts import ENGINE_STATUS_FILE, gate_result
from lmforge.errors import InputDataError, LmforgeError
from lmforge.onnx_runtime import (
    NO_PAST_FILE,
    POSITION_IDS,
    WITH_PAST_FILE,
    cpu_session,
    positions_from_mask,
    resolve_model_file,
)
from lmforge.results import StageResult

log = logging.getLogger("lmforge.export")

KIND = "tensorrt-engine"
ENGINE_FILE = "engine.plan"
BUILD_RECORD = "build_record.json"
PAST_PREFIX = "past_key_values."

Shape = tuple[int, ...]
Dims = Sequence[int | str]
"""A graph input's dimensions: an int where static, the symbol's name where dynamic."""


class TensorRTBuildError(LmforgeError):
    """TensorRT could not parse the ONNX model or build an engine from it."""


def optimization_profiles(cfg: TensorRTConfig, inputs: Mapping[str, Dims]) -> dict[str, tuple[Shape, Shape, Shape]]:
    """``{input name: (min, opt, max) shape}`` of the single optimization profile, from ``cfg``.

    Rules: ``input_ids`` and ``position_ids`` are ``[batch, seq]``; ``attention_mask`` is ``[batch, seq]`` without a
    cache and ``[batch, past + seq]`` with one; ``past_key_values.*`` is ``[batch, heads, past, head_dim]`` with heads
    and head size read from the graph.
    """
    with_past = any(name.startswith(PAST_PREFIX) for name in inputs)
    batch = (cfg.min_batch, cfg.opt_batch, cfg.max_batch)
    seq = (cfg.min_seq, cfg.opt_seq, cfg.max_seq)
    past = (cfg.min_past, cfg.opt_past, cfg.max_past) if with_past else (0, 0, 0)
    profiles: dict[str, tuple[Shape, Shape, Shape]] = {}
    for name, dims in inputs.items():
        if name in ("input_ids", POSITION_IDS):
            shapes = [(b, s) for b, s in zip(batch, seq, strict=True)]
        elif name == "attention_mask":
            shapes = [(b, p + s) for b, p, s in zip(batch, past, seq, strict=True)]
        elif name.startswith(PAST_PREFIX):
            if len(dims) != 4 or not isinstance(dims[1], int) or not isinstance(dims[3], int):
                raise InputDataError(f"graph input {name!r} must be [batch, heads, past, head_dim] with static heads")
            shapes = [(b, dims[1], p, dims[3]) for b, p in zip(batch, past, strict=True)]
        else:
            raise InputDataError(
                f"no optimization-profile rule for graph input {name!r}; known: input_ids, attention_mask, "
                f"{POSITION_IDS}, {PAST_PREFIX}*"
            )
        profiles[name] = (shapes[0], shapes[1], shapes[2])
    return profiles


def select_graph(cfg: TensorRTConfig, model_dir: Path) -> Path:
    """The ONNX file to build: ``cfg.graph``, or with ``auto`` the cache graph when present."""
    if cfg.graph == "no_past" or (cfg.graph == "auto" and not (model_dir / WITH_PAST_FILE).is_file()):
        return resolve_model_file(model_dir / NO_PAST_FILE if model_dir.is_dir() else model_dir)
    path = model_dir / WITH_PAST_FILE
    if not path.is_file():
        raise InputDataError(f"{model_dir}: graph with_past requested but {WITH_PAST_FILE} is missing")
    return path


def _shape_arg(profile: Mapping[str, Shape]) -> str:
    return ",".join(f"{name}:{'x'.join(str(d) for d in shape)}" for name, shape in profile.items())


def trtexec_command(
    cfg: TensorRTConfig,
    model_file: Path,
    engine_file: Path,
    profiles: Mapping[str, tuple[Shape, Shape, Shape]],
    *,
    timing_cache: Path | None,
) -> list[str]:
    """The ``trtexec`` argument list that builds (and times) the engine ``build_tensorrt`` would build."""
    command = [
        cfg.trtexec,
        f"--onnx={model_file}",
        f"--saveEngine={engine_file}",
        f"--memPoolSize=workspace:{round(cfg.workspace_gib * 1024)}M",
        f"--minShapes={_shape_arg({n: s[0] for n, s in profiles.items()})}",
        f"--optShapes={_shape_arg({n: s[1] for n, s in profiles.items()})}",
        f"--maxShapes={_shape_arg({n: s[2] for n, s in profiles.items()})}",
    ]
    # Q/DQ and FP32 graphs carry their own types (strongly typed); FP16 from an FP32 graph needs the flag.
    command.append("--fp16" if cfg.precision == "fp16" else "--stronglyTyped")
    if timing_cache is not None:
        command.append(f"--timingCacheFile={timing_cache}")
    return command


# The summary's own "Latency:" line: only "[timestamp] [I] " before it, so "H2D Latency:", "D2H Latency:" and
# "End-to-End Host Latency:" (trtexec prints them in the same summary) are not taken for it.
_LATENCY = re.compile(r"^(?:\[[^\]]*\]\s*)*Latency: (?P<body>.*)$", re.MULTILINE)
_STAT = re.compile(r"(?P<key>min|max|mean|median|percentile\((?P<pct>[\d.]+)%\)) = (?P<value>[\d.eE+-]+) ms")


def parse_trtexec_output(text: str) -> dict[str, Any]:
    """Facts from ``trtexec``'s log: version, device, build seconds, latency (ms) and throughput, and status."""
    facts: dict[str, Any] = {"passed": "&&&& PASSED" in text}
    if m := re.search(r"TensorRT version: ([\d.]+)", text):
        facts["tensorrt_version"] = m.group(1)
    if m := re.search(r"Selected Device: (.+?)\s*$", text, re.MULTILINE):
        facts["gpu"] = m.group(1)
    if m := re.search(r"Engine built in ([\d.]+) sec", text):
        facts["build_seconds"] = float(m.group(1))
    if m := re.search(r"Throughput: ([\d.]+) qps", text):
        facts["throughput_qps"] = float(m.group(1))
    if m := _LATENCY.search(text):
        latency = {}
        for stat in _STAT.finditer(m.group("body")):
            key = f"p{stat.group('pct').removesuffix('.0')}" if stat.group("pct") else stat.group("key")
            latency[f"{key}_ms"] = float(stat.group("value"))
        facts["latency"] = latency
    return facts


def timing_cache_record(path: Path | None) -> dict[str, Any] | None:
    """What the build record says about the timing cache, taken before the build: path and whether reused."""
    if path is None:
        return None
    return {"path": str(path), "reused": path.is_file() and path.stat().st_size > 0}


def unavailable_reason(cfg: TensorRTConfig | None = None) -> str | None:
    """Why an engine cannot be built here (no ``tensorrt`` package or ``trtexec``, no CUDA GPU), or ``None``."""
    if cfg is not None and cfg.builder == "trtexec":
        if shutil.which(cfg.trtexec) is None:
            return f"{cfg.trtexec} is not on PATH (use the TensorRT image)"
    elif importlib.util.find_spec("tensorrt") is None:
        return "the tensorrt Python package is not installed (use the TensorRT image)"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    return None


def graph_inputs(model_file: Path) -> dict[str, list[int | str]]:
    """The ONNX graph's runtime inputs (initializers excluded) and their dims (int or symbol name)."""
    model = onnx.load(str(model_file), load_external_data=False)
    initializers = {i.name for i in model.graph.initializer}
    return {
        i.name: [d.dim_value if d.HasField("dim_value") else d.dim_param for d in i.type.tensor_type.shape.dim]
        for i in model.graph.input
        if i.name not in initializers
    }


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
    (root / ENGINE_STATUS_FILE).write_text(json.dumps(content, indent=2), encoding="utf-8")
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
        cache_info = timing_cache_record(timing_cache)
    log.info("building a TensorRT %s engine from %s (%d profile inputs)", precision, model_file, len(profiles))
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
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        if engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT:
            buffers[name] = torch.empty(tuple(context.get_tensor_shape(name)), dtype=torch.float32, device="cuda")
    for name, tensor in buffers.items():
        context.set_tensor_address(name, tensor.data_ptr())
    stream = torch.cuda.Stream()
    if not context.execute_async_v3(stream.cuda_stream):
        raise TensorRTBuildError("TensorRT engine failed to execute the smoke-test batch")
    stream.synchronize()
    return buffers["logits"].cpu().numpy()


def _run_trtexec(command: list[str]) -> str:
    """Run ``trtexec``; return its log, or raise with the last lines when it failed."""
    log.info("running %s", " ".join(command))
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    output = done.stdout + done.stderr
    if done.returncode != 0 or "&&&& FAILED" in output:
        tail = " | ".join(output.strip().splitlines()[-5:])
        raise TensorRTBuildError(f"trtexec exited with status {done.returncode}: {tail}")
    return output


# -----------------------------------------------------------------------------------------------------


def smoke_feeds(
    profiles: Mapping[str, tuple[Shape, Shape, Shape]], vocab_size: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Deterministic inputs at the profile's opt shapes: random ids, an all-ones mask, the positions of the new
    tokens after the past, a random past."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, (_, opt, _) in profiles.items():
        if name == "input_ids":
            feeds[name] = rng.integers(0, vocab_size, size=opt, dtype=np.int64)
        elif name == "attention_mask":
            feeds[name] = np.ones(opt, dtype=np.int64)
        elif name == POSITION_IDS:
            mask_shape = profiles["attention_mask"][1] if "attention_mask" in profiles else opt
            feeds[name] = positions_from_mask(np.ones(mask_shape, dtype=np.int64), opt[1])
        else:
            feeds[name] = rng.standard_normal(opt).astype(np.float32)
    return feeds


def _smoke_test(plan: bytes, model_file: Path, profiles: Mapping, vocab_size: int) -> dict[str, Any]:
    """Compare engine logits with ONNX Runtime on one deterministic batch at the profile's opt shapes."""
    feeds = smoke_feeds(profiles, vocab_size)
    (expected,) = cpu_session(model_file).run(["logits"], feeds)
    actual = _run_engine(plan, feeds)
    if actual.shape != expected.shape or not np.isfinite(actual).all():
        raise TensorRTBuildError(f"engine logits shape {actual.shape} or values are wrong (ORT {expected.shape})")
    agree = float(np.mean(actual.argmax(-1) == expected.argmax(-1)))
    return {
        "shapes": {name: list(array.shape) for name, array in feeds.items()},
        "max_abs_diff_vs_ort": float(np.max(np.abs(actual - expected))),
        "top1_agreement_vs_ort": agree,
    }


def skip_reason(cfg: TensorRTConfig, int8_qdq: Path) -> str | None:
    """Why no engine is built: TensorRT or a GPU is missing here, or the INT8 model failed its accuracy gate."""
    reason = unavailable_reason(cfg)
    if reason is None and cfg.precision == "int8":
        gate = gate_result(int8_qdq)
        if not gate["accepted"]:
            reason = f"the Q/DQ INT8 model failed the accuracy gate ({gate['reason']}); serve the FP32 model"
    return reason


def _write_skipped(cfg: TensorRTConfig, engine: str | Path, inputs: dict[str, Any], reason: str) -> StageResult:
    """Write the ``skipped`` status and the manifest, and no engine."""
    log.warning("build_tensorrt skipped: %s", reason)
    metrics = {"built": 0.0}
    with staged_output(engine) as out:
        status = write_status(out, "skipped", reason)
        write_manifest(out, KIND, inputs=inputs, config=cfg.model_dump(), metrics=metrics, extra=status)
    return StageResult(metrics=metrics, summary=dict(status))


def build_with_trtexec(
    cfg: TensorRTConfig,
    model_file: Path,
    engine_file: Path,
    profiles: dict[str, tuple[Shape, Shape, Shape]],
    timing_cache: Path | None,
) -> tuple[bytes, dict[str, Any]]:
    """Build ``engine_file`` with ``trtexec``; return the engine and the facts for the build record."""
    cache_info = timing_cache_record(timing_cache)
    text = _run_trtexec(trtexec_command(cfg, model_file, engine_file, profiles, timing_cache=timing_cache))
    trtexec_facts = parse_trtexec_output(text)
    facts = {
        "tensorrt_version": trtexec_facts.get("tensorrt_version", "unknown"),
        "strongly_typed": cfg.precision != "fp16",
        "timing_cache": cache_info,
        "trtexec": trtexec_facts,
    }
    return engine_file.read_bytes(), facts


def build_with_python_api(
    cfg: TensorRTConfig,
    model_file: Path,
    engine_file: Path,
    profiles: dict[str, tuple[Shape, Shape, Shape]],
    timing_cache: Path | None,
) -> tuple[bytes, dict[str, Any]]:
    """Build the engine with the TensorRT Python API and write it to ``engine_file``; return it and the facts."""
    plan, facts = _build_engine(
        model_file,
        profiles,
        precision=cfg.precision,
        workspace_bytes=int(cfg.workspace_gib * (1 << 30)),
        timing_cache=timing_cache,
    )
    engine_file.write_bytes(plan)
    return plan, facts


def engine_record(
    cfg: TensorRTConfig,
    profiles: dict[str, tuple[Shape, Shape, Shape]],
    facts: Mapping[str, Any],
    *,
    graph: str,
    build_seconds: float,
    smoke: dict[str, Any],
) -> dict[str, Any]:
    """The build record of an engine built here: :func:`build_record` plus the graph, builder and trtexec facts."""
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
    record["graph"] = graph
    record["builder"] = cfg.builder
    if "trtexec" in facts:
        record["trtexec"] = facts["trtexec"]
    return record


def engine_metrics(plan: bytes, build_seconds: float, smoke: Mapping[str, Any]) -> dict[str, float]:
    """The stage's metrics for a built engine: build time, size and the smoke test's agreement with ORT."""
    return {
        "built": 1.0,
        "build_seconds": build_seconds,
        "engine_size_mb": len(plan) / 1e6,
        "smoke_max_abs_diff": smoke["max_abs_diff_vs_ort"],
        "smoke_top1_agreement": smoke["top1_agreement_vs_ort"],
    }


def run(
    cfg: TensorRTConfig,
    *,
    int8_qdq: str | Path,
    engine: str | Path,
    timing_cache: str | Path | None = None,
) -> StageResult:
    """Build a TensorRT engine from the ONNX model in ``int8_qdq``, or record why it was skipped.

    Args:
        timing_cache: a timing-cache file read before and rewritten after the build, so that later builds
            on the same GPU and TensorRT version reuse kernel timings (overrides ``cfg.timing_cache``).
    """
    int8_qdq = Path(int8_qdq)
    resolve_model_file(int8_qdq)
    model_file = select_graph(cfg, int8_qdq) if int8_qdq.is_dir() else int8_qdq
    inputs = {"onnx_model": input_record(int8_qdq)}
    profiles = optimization_profiles(cfg, graph_inputs(model_file))
    if cfg.precision == "int8" and count_qdq_nodes(model_file) == 0:
        raise InputDataError(f"{model_file}: precision int8 needs a Q/DQ model, but the graph has no Q/DQ nodes")
    cache = timing_cache if timing_cache is not None else cfg.timing_cache
    reason = skip_reason(cfg, int8_qdq)
    if reason is not None:
        return _write_skipped(cfg, engine, inputs, reason)

    vocab_size = int(json.loads((int8_qdq / "config.json").read_text(encoding="utf-8"))["vocab_size"])
    build = build_with_trtexec if cfg.builder == "trtexec" else build_with_python_api
    with staged_output(engine) as out:
        start = time.perf_counter()
        plan, facts = build(cfg, model_file, out / ENGINE_FILE, profiles, Path(cache) if cache is not None else None)
        build_seconds = time.perf_counter() - start
        smoke = _smoke_test(plan, model_file, profiles, vocab_size)
        record = engine_record(cfg, profiles, facts, graph=model_file.name, build_seconds=build_seconds, smoke=smoke)
        metrics = engine_metrics(plan, build_seconds, smoke)
        (out / BUILD_RECORD).write_text(json.dumps(record, indent=2), encoding="utf-8")
        status = write_status(out, "built", f"TensorRT {record['tensorrt_version']} on {record['gpu']}")
        write_manifest(out, KIND, inputs=inputs, config=cfg.model_dump(), metrics=metrics, extra=status)
    log.info("built TensorRT engine %s (%.1f MB, %.1f s)", engine, metrics["engine_size_mb"], build_seconds)
    return StageResult(metrics=metrics, summary={**status, "build_record": record})
