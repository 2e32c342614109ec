"""build_tensorrt: profiles and records in plain Python; an explicit skip without TensorRT or a GPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from lmforge.artifacts import write_manifest
from lmforge.config import ExportConfig, QuantizeConfig, TensorRTConfig
from lmforge.errors import InputDataError
from lmforge.export import build_tensorrt, export_onnx, quantize_int8
from lmforge.export.build_tensorrt import (
    build_record,
    optimization_profiles,
    parse_trtexec_output,
    select_graph,
    smoke_feeds,
    timing_cache_record,
    trtexec_command,
)
from lmforge.onnx_runtime import NO_PAST_FILE, WITH_PAST_FILE

PROFILE = TensorRTConfig(min_batch=1, opt_batch=2, max_batch=4, min_seq=1, opt_seq=16, max_seq=32)
NO_CACHE = {"input_ids": ["batch", "seq"], "attention_mask": ["batch", "seq"]}
WITH_PAST = {
    "input_ids": ["batch", "seq"],
    "attention_mask": ["batch", "past_seq"],
    "position_ids": ["batch", "seq"],
    "past_key_values.0.key": ["batch", 12, "past", 64],
    "past_key_values.0.value": ["batch", 12, "past", 64],
}


def _toy_model_dir(root, *, with_qdq: bool):
    """A valid ONNX model directory (embedding lookup as logits), with or without a Q/DQ pair."""
    root.mkdir()
    vocab = 8
    dims = ["batch", "seq"]
    table = numpy_helper.from_array(np.eye(vocab, dtype=np.float32), "table")
    scale = numpy_helper.from_array(np.array(0.01, dtype=np.float32), "scale")
    zero = numpy_helper.from_array(np.array(0, dtype=np.int8), "zero")
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["emb" if with_qdq else "logits"])]
    if with_qdq:
        nodes += [
            helper.make_node("QuantizeLinear", ["emb", "scale", "zero"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["logits"]),
        ]
    graph = helper.make_graph(
        nodes,
        "toy",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, dims),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, dims),
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [*dims, vocab])],
        initializer=[table, scale, zero],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model)
    onnx.save(model, str(root / NO_PAST_FILE))
    (root / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    write_manifest(root, "onnx-model", extra={"quantization": "qdq-int8" if with_qdq else "none"})
    return root


def test_optimization_profiles_give_min_opt_max_batch_by_seq_per_input():
    assert optimization_profiles(PROFILE, NO_CACHE) == {
        "input_ids": ((1, 1), (2, 16), (4, 32)),
        "attention_mask": ((1, 1), (2, 16), (4, 32)),
    }
    assert optimization_profiles(TensorRTConfig(), {"input_ids": ["b", "s"]}) == {
        "input_ids": ((1, 1), (4, 64), (8, 128))
    }


def test_optimization_profiles_of_the_cache_graph_cover_past_length_from_zero():
    cfg = PROFILE.model_copy(update={"min_past": 0, "opt_past": 100, "max_past": 200})
    assert optimization_profiles(cfg, WITH_PAST) == {
        "input_ids": ((1, 1), (2, 16), (4, 32)),
        "attention_mask": ((1, 1), (2, 116), (4, 232)),
        "position_ids": ((1, 1), (2, 16), (4, 32)),
        "past_key_values.0.key": ((1, 12, 0, 64), (2, 12, 100, 64), (4, 12, 200, 64)),
        "past_key_values.0.value": ((1, 12, 0, 64), (2, 12, 100, 64), (4, 12, 200, 64)),
    }


def test_optimization_profiles_refuse_an_input_without_a_rule_or_a_dynamic_head_count():
    with pytest.raises(InputDataError, match="'token_type_ids'"):
        optimization_profiles(PROFILE, {"input_ids": ["b", "s"], "token_type_ids": ["b", "s"]})
    with pytest.raises(InputDataError, match="static heads"):
        optimization_profiles(PROFILE, {"past_key_values.0.key": ["b", "heads", "past", 64]})


def test_profile_past_lengths_must_be_ordered():
    with pytest.raises(ValueError, match="min_past <= opt_past <= max_past"):
        TensorRTConfig(min_past=10, opt_past=5)


def test_trtexec_command_carries_shapes_precision_workspace_and_timing_cache(tmp_path):
    cfg = PROFILE.model_copy(update={"min_past": 0, "opt_past": 100, "max_past": 200, "workspace_gib": 2.5})
    profiles = optimization_profiles(cfg, WITH_PAST)
    command = trtexec_command(
        cfg, tmp_path / "m.onnx", tmp_path / "e.plan", profiles, timing_cache=tmp_path / "t.cache"
    )
    assert command == [
        "trtexec",
        f"--onnx={tmp_path / 'm.onnx'}",
        f"--saveEngine={tmp_path / 'e.plan'}",
        "--memPoolSize=workspace:2560M",
        "--minShapes=input_ids:1x1,attention_mask:1x1,position_ids:1x1,past_key_values.0.key:1x12x0x64,"
        "past_key_values.0.value:1x12x0x64",
        "--optShapes=input_ids:2x16,attention_mask:2x116,position_ids:2x16,past_key_values.0.key:2x12x100x64,"
        "past_key_values.0.value:2x12x100x64",
        "--maxShapes=input_ids:4x32,attention_mask:4x232,position_ids:4x32,past_key_values.0.key:4x12x200x64,"
        "past_key_values.0.value:4x12x200x64",
        "--stronglyTyped",
        f"--timingCacheFile={tmp_path / 't.cache'}",
    ]
    fp16 = trtexec_command(
        PROFILE.model_copy(update={"precision": "fp16", "trtexec": "/opt/trt/bin/trtexec"}),
        tmp_path / "m.onnx",
        tmp_path / "e.plan",
        optimization_profiles(PROFILE, NO_CACHE),
        timing_cache=None,
    )
    assert fp16[0] == "/opt/trt/bin/trtexec" and fp16[-1] == "--fp16" and not any("timingCache" in a for a in fp16)


TRTEXEC_LOG = """\
&&&& RUNNING TensorRT.trtexec [TensorRT v100900] [b34] # trtexec --onnx=model.onnx
[11/29/2026-10:00:00] [I] TensorRT version: 10.9.0
[11/29/2026-10:00:00] [I] Selected Device: NVIDIA H200
[11/29/2026-10:00:40] [I] Engine built in 38.512 sec.
[11/29/2026-10:00:44] [I] === Trace details ===
[11/29/2026-10:00:44] [I] H2D Latency: min = 0.01 ms, max = 0.02 ms, mean = 0.015 ms, median = 0.015 ms
[11/29/2026-10:00:44] [I] === Performance summary ===
[11/29/2026-10:00:44] [I] Throughput: 2841.7 qps
[11/29/2026-10:00:44] [I] Latency: min = 0.331 ms, max = 0.512 ms, mean = 0.348 ms, median = 0.345 ms, \
percentile(90%) = 0.36 ms, percentile(95%) = 0.371 ms, percentile(99%) = 0.402 ms
[11/29/2026-10:00:44] [I] Enqueue Time: min = 0.008 ms, max = 0.05 ms, mean = 0.012 ms, median = 0.009 ms
[11/29/2026-10:00:44] [I] H2D Latency: min = 0.012 ms, max = 0.03 ms, mean = 0.016 ms, median = 0.015 ms
[11/29/2026-10:00:44] [I] GPU Compute Time: min = 0.3 ms, max = 0.48 ms, mean = 0.32 ms, median = 0.318 ms
[11/29/2026-10:00:44] [I] D2H Latency: min = 0.01 ms, max = 0.02 ms, mean = 0.012 ms, median = 0.012 ms
&&&& PASSED TensorRT.trtexec [TensorRT v100900] [b34] # trtexec --onnx=model.onnx
"""


def test_parse_trtexec_output_reads_version_device_build_time_and_latency():
    assert parse_trtexec_output(TRTEXEC_LOG) == {
        "passed": True,
        "tensorrt_version": "10.9.0",
        "gpu": "NVIDIA H200",
        "build_seconds": 38.512,
        "throughput_qps": 2841.7,
        "latency": {
            "min_ms": 0.331,
            "max_ms": 0.512,
            "mean_ms": 0.348,
            "median_ms": 0.345,
            "p90_ms": 0.36,
            "p95_ms": 0.371,
            "p99_ms": 0.402,
        },
    }
    assert parse_trtexec_output("&&&& FAILED TensorRT.trtexec") == {"passed": False}


def test_timing_cache_is_reused_once_a_build_wrote_it(tmp_path):
    cache = tmp_path / "cache" / "trt.cache"
    assert timing_cache_record(None) is None
    assert timing_cache_record(cache) == {"path": str(cache), "reused": False}
    cache.parent.mkdir()
    cache.write_bytes(b"")
    assert timing_cache_record(cache)["reused"] is False  # an empty file holds no timings
    cache.write_bytes(b"timings")
    assert timing_cache_record(cache) == {"path": str(cache), "reused": True}


def test_select_graph_prefers_the_cache_graph_when_present(tmp_path):
    root = tmp_path / "m"
    root.mkdir()
    (root / NO_PAST_FILE).write_bytes(b"x")
    assert select_graph(TensorRTConfig(), root) == root / NO_PAST_FILE
    with pytest.raises(InputDataError, match=f"{WITH_PAST_FILE} is missing"):
        select_graph(TensorRTConfig(graph="with_past"), root)
    (root / WITH_PAST_FILE).write_bytes(b"x")
    assert select_graph(TensorRTConfig(), root) == root / WITH_PAST_FILE
    assert select_graph(TensorRTConfig(graph="no_past"), root) == root / NO_PAST_FILE


def test_smoke_feeds_fill_the_opt_shapes_deterministically():
    profiles = optimization_profiles(PROFILE.model_copy(update={"opt_past": 5}), WITH_PAST)
    feeds = smoke_feeds(profiles, vocab_size=50)
    assert {n: a.shape for n, a in feeds.items()} == {
        "input_ids": (2, 16),
        "attention_mask": (2, 21),
        "position_ids": (2, 16),
        "past_key_values.0.key": (2, 12, 5, 64),
        "past_key_values.0.value": (2, 12, 5, 64),
    }
    assert feeds["input_ids"].max() < 50 and feeds["attention_mask"].all()
    assert feeds["position_ids"].dtype == np.int64
    np.testing.assert_array_equal(feeds["position_ids"], np.tile(np.arange(5, 21), (2, 1)))  # after the 5 cached
    np.testing.assert_array_equal(smoke_feeds(profiles, 50)["input_ids"], feeds["input_ids"])


def test_build_record_lists_version_gpu_precision_and_profiles():
    profiles = optimization_profiles(PROFILE, {"input_ids": ["b", "s"]})
    record = build_record(
        PROFILE,
        profiles,
        tensorrt_version="10.9.0",
        gpu_name="NVIDIA H200",
        build_seconds=12.5,
        strongly_typed=True,
        timing_cache={"path": "/cache/trt.cache", "reused": False},
        smoke=None,
    )
    assert record["tensorrt_version"] == "10.9.0"
    assert record["gpu"] == "NVIDIA H200"
    assert record["precision"] == "int8"
    assert record["profiles"] == [{"input_ids": {"min": [1, 1], "opt": [2, 16], "max": [4, 32]}}]
    assert record["build_seconds"] == 12.5
    json.dumps(record)  # the record must be JSON-serializable as is


def test_unavailable_reason_names_the_missing_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorrt" else real(name, *a))
    assert "tensorrt Python package is not installed" in build_tensorrt.unavailable_reason()


def test_unavailable_reason_names_a_missing_trtexec():
    cfg = TensorRTConfig(builder="trtexec", trtexec="/nonexistent/trtexec")
    assert build_tensorrt.unavailable_reason(cfg) == "/nonexistent/trtexec is not on PATH (use the TensorRT image)"


def test_unavailable_reason_names_the_missing_gpu(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "tensorrt" else real(name, *a)
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA GPU" in build_tensorrt.unavailable_reason()


def test_without_tensorrt_run_writes_skipped_status_and_no_engine(tmp_path, monkeypatch):
    monkeypatch.setattr(
        build_tensorrt, "unavailable_reason", lambda cfg: "the tensorrt Python package is not installed"
    )
    qdq_dir = _toy_model_dir(tmp_path / "qdq", with_qdq=True)
    out = tmp_path / "engine"
    result = build_tensorrt.run(PROFILE, int8_qdq=qdq_dir, engine=out)
    assert result.summary == {"status": "skipped", "reason": "the tensorrt Python package is not installed"}
    assert result.metrics == {"built": 0}
    assert json.loads((out / "status.json").read_text()) == result.summary
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kind"] == "tensorrt-engine" and manifest["status"] == "skipped"
    assert manifest["inputs"]["onnx_model"]["uri"] == str(qdq_dir)
    assert not list(out.glob("*.plan"))


@pytest.mark.skipif(build_tensorrt.unavailable_reason() is None, reason="this machine can build TensorRT engines")
def test_on_this_machine_run_skips_with_the_real_reason(tmp_path):
    out = tmp_path / "engine"
    result = build_tensorrt.run(PROFILE, int8_qdq=_toy_model_dir(tmp_path / "qdq", with_qdq=True), engine=out)
    assert result.summary["status"] == "skipped" and result.summary["reason"] == build_tensorrt.unavailable_reason(
        PROFILE
    )
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "status.json"]


def test_a_qdq_model_rejected_by_the_accuracy_gate_is_not_built(tmp_path, monkeypatch):
    monkeypatch.setattr(build_tensorrt, "unavailable_reason", lambda cfg: None)  # as on a GPU node
    monkeypatch.setattr(build_tensorrt, "_build_engine", lambda *a, **k: pytest.fail("must not build"))
    qdq_dir = _toy_model_dir(tmp_path / "qdq", with_qdq=True)
    write_manifest(
        qdq_dir,
        "onnx-model",
        extra={"quantization": "qdq-int8", "accuracy_gate": {"accepted": False, "reason": "rejected: +38%"}},
    )
    result = build_tensorrt.run(PROFILE, int8_qdq=qdq_dir, engine=tmp_path / "engine")
    assert result.summary["status"] == "skipped"
    assert result.summary["reason"] == (
        "the Q/DQ INT8 model failed the accuracy gate (rejected: +38%); serve the FP32 model"
    )


def test_int8_build_refuses_a_model_without_qdq_nodes(tmp_path):
    fp32_dir = _toy_model_dir(tmp_path / "fp32", with_qdq=False)
    with pytest.raises(InputDataError, match="no Q/DQ nodes"):
        build_tensorrt.run(PROFILE, int8_qdq=fp32_dir, engine=tmp_path / "engine")
    assert not (tmp_path / "engine").exists()


NO_BUILD_REASON = build_tensorrt.unavailable_reason(PROFILE)
# The tiny model has 64 positions: past + new tokens must stay within them at every profile shape.
GPU_PROFILE = PROFILE.model_copy(update={"min_past": 0, "opt_past": 8, "max_past": 32})


@pytest.mark.gpu
@pytest.mark.skipif(NO_BUILD_REASON is not None, reason=f"cannot build a TensorRT engine here: {NO_BUILD_REASON}")
def test_builds_an_int8_engine_from_the_qdq_model_and_reuses_the_timing_cache(
    tmp_path, tiny_model_dir, tiny_shards_dir
):
    onnx_dir, qdq_dir = tmp_path / "onnx", tmp_path / "qdq"
    export_onnx.run(ExportConfig(), model=tiny_model_dir, onnx_model=onnx_dir)
    calibration = QuantizeConfig(calibration_sequences=8, calibration_seq_len=32)
    quantize_int8.run(
        calibration, onnx_model=onnx_dir, shards=tiny_shards_dir, int8_dynamic=tmp_path / "dynamic", int8_qdq=qdq_dir
    )
    cache = tmp_path / "timing.cache"
    result = build_tensorrt.run(GPU_PROFILE, int8_qdq=qdq_dir, engine=tmp_path / "engine", timing_cache=cache)
    assert result.metrics["built"] == 1
    assert (tmp_path / "engine" / "engine.plan").stat().st_size > 0
    record = json.loads((tmp_path / "engine" / "build_record.json").read_text())
    assert record["precision"] == "int8" and record["strongly_typed"] and record["gpu"]
    assert record["graph"] == WITH_PAST_FILE
    assert record["smoke_test"]["shapes"]["input_ids"] == [2, 16]
    assert set(record["profiles"][0]) >= {"input_ids", "attention_mask", "past_key_values.0.key"}
    assert np.isfinite(record["smoke_test"]["max_abs_diff_vs_ort"])
    assert cache.stat().st_size > 0 and record["timing_cache"]["reused"] is False
    again = build_tensorrt.run(GPU_PROFILE, int8_qdq=qdq_dir, engine=tmp_path / "engine2", timing_cache=cache)
    assert again.summary["build_record"]["timing_cache"]["reused"] is True


@pytest.fixture
def gated_qdq_on_a_gpu_node(tmp_path, monkeypatch):
    """An accepted Q/DQ model on a GPU node faked without TensorRT: the engine answers ONNX Runtime's logits + 0.5."""
    qdq_dir = _toy_model_dir(tmp_path / "qdq", with_qdq=True)
    gate = {"accepted": True, "reason": "accepted: +0.1%"}
    write_manifest(qdq_dir, "onnx-model", extra={"quantization": "qdq-int8", "accuracy_gate": gate})
    monkeypatch.setattr(build_tensorrt, "unavailable_reason", lambda cfg: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Fake GPU")

    def run_engine(plan, feeds):
        assert plan.startswith(b"PLAN")
        return build_tensorrt.cpu_session(qdq_dir / NO_PAST_FILE).run(["logits"], feeds)[0] + 0.5

    monkeypatch.setattr(build_tensorrt, "_run_engine", run_engine)
    return qdq_dir


def test_a_built_engine_is_written_with_its_build_record_smoke_test_and_status(
    tmp_path, monkeypatch, gated_qdq_on_a_gpu_node
):
    qdq_dir = gated_qdq_on_a_gpu_node
    built = []

    def build_engine(model_file, profiles, *, precision, workspace_bytes, timing_cache):
        built.append((model_file, precision, workspace_bytes, timing_cache))
        facts = {"tensorrt_version": "10.9", "strongly_typed": True, "timing_cache": timing_cache_record(timing_cache)}
        return b"PLAN" * 250_000, facts

    monkeypatch.setattr(build_tensorrt, "_build_engine", build_engine)
    out, cache = tmp_path / "engine", tmp_path / "timing.cache"
    result = build_tensorrt.run(PROFILE, int8_qdq=qdq_dir, engine=out, timing_cache=cache)

    assert built == [(qdq_dir / NO_PAST_FILE, "int8", int(PROFILE.workspace_gib * (1 << 30)), cache)]
    assert (out / "engine.plan").read_bytes() == b"PLAN" * 250_000
    record = json.loads((out / "build_record.json").read_text())
    assert record == result.summary["build_record"]
    assert (record["tensorrt_version"], record["gpu"], record["graph"], record["builder"]) == (
        "10.9",
        "Fake GPU",
        NO_PAST_FILE,
        "python",
    )
    assert record["timing_cache"] == {"path": str(cache), "reused": False} and "trtexec" not in record
    assert record["smoke_test"]["shapes"] == {"input_ids": [2, 16], "attention_mask": [2, 16]}
    assert record["smoke_test"]["max_abs_diff_vs_ort"] == pytest.approx(0.5)
    assert record["smoke_test"]["top1_agreement_vs_ort"] == 1.0
    status = {"status": "built", "reason": "TensorRT 10.9 on Fake GPU"}
    assert json.loads((out / "status.json").read_text()) == status
    assert {k: v for k, v in result.summary.items() if k != "build_record"} == status
    assert result.metrics["built"] == 1.0 and result.metrics["engine_size_mb"] == 1.0
    assert result.metrics["smoke_max_abs_diff"] == pytest.approx(0.5) and result.metrics["smoke_top1_agreement"] == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "built" and set(manifest["files"]) == {
        "engine.plan",
        "build_record.json",
        "status.json",
    }


def test_a_trtexec_build_records_what_trtexec_printed(tmp_path, monkeypatch, gated_qdq_on_a_gpu_node):
    qdq_dir = gated_qdq_on_a_gpu_node
    monkeypatch.setattr(build_tensorrt.shutil, "which", lambda program: f"/usr/bin/{program}")

    def trtexec(command):
        engine_file = next(arg.split("=", 1)[1] for arg in command if arg.startswith("--saveEngine="))
        Path(engine_file).write_bytes(b"PLAN" * 10)
        return "[I] TensorRT version: 10.3.0\n[I] Selected Device: Fake GPU\n&&&& PASSED TensorRT.trtexec\n"

    monkeypatch.setattr(build_tensorrt, "_run_trtexec", trtexec)
    cfg = PROFILE.model_copy(update={"builder": "trtexec"})
    result = build_tensorrt.run(cfg, int8_qdq=qdq_dir, engine=tmp_path / "engine")

    record = json.loads((tmp_path / "engine" / "build_record.json").read_text())
    assert record["builder"] == "trtexec" and record["tensorrt_version"] == "10.3.0" and record["strongly_typed"]
    assert record["trtexec"] == {"passed": True, "tensorrt_version": "10.3.0", "gpu": "Fake GPU"}
    assert record["timing_cache"] is None
    assert result.summary["reason"] == "TensorRT 10.3.0 on Fake GPU" and result.metrics["engine_size_mb"] == 40 / 1e6
