"""build_tensorrt: profiles and records in plain Python; an explicit skip without TensorRT or a GPU."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from lmforge.artifacts import write_manifest
from lmforge.config import ExportConfig, QuantizeConfig, TensorRTConfig
from lmforge.errors import InputDataError
from lmforge.export import onnx_export, quantize, tensorrt
from lmforge.export.tensorrt import build_record, optimization_profiles

PROFILE = TensorRTConfig(min_batch=1, opt_batch=2, max_batch=4, min_seq=1, opt_seq=16, max_seq=32)


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
    onnx.save(model, str(root / "model.onnx"))
    (root / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    write_manifest(root, "onnx-model", extra={"quantization": "qdq-int8" if with_qdq else "none"})
    return root


def test_optimization_profiles_give_min_opt_max_batch_by_seq_per_input():
    assert optimization_profiles(PROFILE, ["input_ids", "attention_mask"]) == {
        "input_ids": ((1, 1), (2, 16), (4, 32)),
        "attention_mask": ((1, 1), (2, 16), (4, 32)),
    }
    assert optimization_profiles(TensorRTConfig(), ["input_ids"]) == {"input_ids": ((1, 1), (4, 64), (8, 128))}


def test_optimization_profiles_refuse_an_input_without_a_rule():
    with pytest.raises(InputDataError, match="'past_key_values.0.key'"):
        optimization_profiles(PROFILE, ["input_ids", "past_key_values.0.key"])


def test_build_record_lists_version_gpu_precision_and_profiles():
    profiles = optimization_profiles(PROFILE, ["input_ids"])
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
    assert "tensorrt Python package is not installed" in tensorrt.unavailable_reason()


def test_unavailable_reason_names_the_missing_gpu(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "tensorrt" else real(name, *a)
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA GPU" in tensorrt.unavailable_reason()


def test_without_tensorrt_run_writes_skipped_status_and_no_engine(tmp_path, monkeypatch):
    monkeypatch.setattr(tensorrt, "unavailable_reason", lambda: "the tensorrt Python package is not installed")
    qdq_dir = _toy_model_dir(tmp_path / "qdq", with_qdq=True)
    out = tmp_path / "engine"
    result = tensorrt.run(PROFILE, qdq_dir, out)
    assert result.summary == {"status": "skipped", "reason": "the tensorrt Python package is not installed"}
    assert result.metrics == {"built": 0}
    assert json.loads((out / "status.json").read_text()) == result.summary
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kind"] == "tensorrt-engine" and manifest["status"] == "skipped"
    assert manifest["inputs"]["onnx_model"]["uri"] == str(qdq_dir)
    assert not list(out.glob("*.plan"))


@pytest.mark.skipif(tensorrt.unavailable_reason() is None, reason="this machine can build TensorRT engines")
def test_on_this_machine_run_skips_with_the_real_reason(tmp_path):
    out = tmp_path / "engine"
    result = tensorrt.run(PROFILE, _toy_model_dir(tmp_path / "qdq", with_qdq=True), out)
    assert result.summary["status"] == "skipped" and result.summary["reason"] == tensorrt.unavailable_reason()
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "status.json"]


def test_int8_build_refuses_a_model_without_qdq_nodes(tmp_path):
    fp32_dir = _toy_model_dir(tmp_path / "fp32", with_qdq=False)
    with pytest.raises(InputDataError, match="no Q/DQ nodes"):
        tensorrt.run(PROFILE, fp32_dir, tmp_path / "engine")
    assert not (tmp_path / "engine").exists()


NO_BUILD_REASON = tensorrt.unavailable_reason()


@pytest.mark.gpu
@pytest.mark.skipif(NO_BUILD_REASON is not None, reason=f"cannot build a TensorRT engine here: {NO_BUILD_REASON}")
def test_builds_an_int8_engine_from_the_qdq_model_and_reuses_the_timing_cache(
    tmp_path, tiny_model_dir, tiny_shards_dir
):
    onnx_dir, qdq_dir = tmp_path / "onnx", tmp_path / "qdq"
    onnx_export.run(ExportConfig(), tiny_model_dir, onnx_dir)
    calibration = QuantizeConfig(calibration_sequences=8, calibration_seq_len=32)
    quantize.run(calibration, onnx_dir, tiny_shards_dir, tmp_path / "dynamic", qdq_dir)
    cache = tmp_path / "timing.cache"
    result = tensorrt.run(PROFILE, qdq_dir, tmp_path / "engine", timing_cache=cache)
    assert result.metrics["built"] == 1
    assert (tmp_path / "engine" / "engine.plan").stat().st_size > 0
    record = json.loads((tmp_path / "engine" / "build_record.json").read_text())
    assert record["precision"] == "int8" and record["strongly_typed"] and record["gpu"]
    assert record["smoke_test"]["shape"] == [2, 16]
    assert np.isfinite(record["smoke_test"]["max_abs_diff_vs_ort"])
    assert cache.stat().st_size > 0 and record["timing_cache"]["reused"] is False
    again = tensorrt.run(PROFILE, qdq_dir, tmp_path / "engine2", timing_cache=cache)
    assert again.summary["build_record"]["timing_cache"]["reused"] is True
