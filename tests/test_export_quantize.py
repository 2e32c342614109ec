"""quantize_int8: dynamic INT8 for CPU and calibrated symmetric Q/DQ INT8 for TensorRT."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from lmforge.artifacts import write_manifest
from lmforge.config import ExportConfig, ModelConfig, QuantizeConfig
from lmforge.data.shards import ShardWriter
from lmforge.data.tokenizer import tokenizer_fingerprint
from lmforge.errors import InputDataError
from lmforge.export import onnx_export, quantize
from lmforge.export.ort import OrtCausalLM
from lmforge.export.quantize import TokenWindowReader, calibration_windows
from lmforge.model.build import build_model, load_tokenizer, save_model_dir

# Wide enough that the int8 weights, not the fixed graph overhead, dominate the file size.
MODEL = ModelConfig(arch="gpt2", n_layer=2, n_head=2, n_embd=64, block_size=64)
CFG = QuantizeConfig(calibration_sequences=12, calibration_seq_len=32)


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory, tiny_tokenizer_dir):
    tok = load_tokenizer(tiny_tokenizer_dir)
    model = build_model(MODEL, len(tok), eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, seed=0)
    model_dir = save_model_dir(model, tok, tmp_path_factory.mktemp("model64"))
    write_manifest(model_dir, "model")
    out = tmp_path_factory.mktemp("export64") / "onnx"
    onnx_export.run(ExportConfig(), model_dir, out)
    return out


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, onnx_dir, tiny_shards_dir):
    root = tmp_path_factory.mktemp("quant")
    result = quantize.run(CFG, onnx_dir, tiny_shards_dir, root / "dynamic", root / "qdq")
    return root / "dynamic", root / "qdq", result


def test_both_int8_models_load_and_give_finite_logits(quantized):
    ids = np.random.default_rng(0).integers(0, 512, size=(2, 16), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    for model_dir in quantized[:2]:
        logits = OrtCausalLM(model_dir, threads=1).logits(ids, mask)
        assert logits.shape == (2, 16, 512) and logits.dtype == np.float32
        assert np.isfinite(logits).all()


def test_dynamic_model_is_smaller_than_fp32(quantized, onnx_dir):
    dynamic_dir, qdq_dir, result = quantized
    fp32 = OrtCausalLM(onnx_dir).size_bytes
    assert OrtCausalLM(dynamic_dir).size_bytes < fp32 / 2
    assert OrtCausalLM(qdq_dir).size_bytes < fp32
    assert result.metrics["fp32_size_mb"] == pytest.approx(fp32 / 1e6)
    assert result.metrics["calibration_sequences"] == 12


def test_outputs_follow_the_onnx_model_contract(quantized, onnx_dir):
    dynamic_dir, qdq_dir, _ = quantized
    for model_dir, kind in ((dynamic_dir, "dynamic-int8"), (qdq_dir, "qdq-int8")):
        for name in ("model.onnx", "manifest.json", "tokenizer.json", "tokenizer_config.json", "config.json"):
            assert (model_dir / name).is_file(), f"{model_dir.name}/{name}"
        assert tokenizer_fingerprint(model_dir) == tokenizer_fingerprint(onnx_dir)
        manifest = json.loads((model_dir / "manifest.json").read_text())
        assert manifest["kind"] == "onnx-model"
        assert manifest["quantization"] == kind
        assert manifest["inputs"]["onnx_model"]["kind"] == "onnx-model"
        graph = onnx.load(str(model_dir / "model.onnx")).graph
        assert [i.name for i in graph.input] == ["input_ids", "attention_mask"]
        assert [o.name for o in graph.output] == ["logits"]
    qdq = json.loads((qdq_dir / "manifest.json").read_text())
    assert qdq["calibrate_method"] == "minmax" and qdq["calibration_sequences"] == 12 and qdq["symmetric"]


def test_qdq_model_uses_symmetric_int8_scales_for_tensorrt(quantized):
    model = onnx.load(str(quantized[1] / "model.onnx"))
    initializers = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    qdq_nodes = [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert any(n.op_type == "QuantizeLinear" for n in qdq_nodes)
    zero_points = [initializers[n.input[2]] for n in qdq_nodes if len(n.input) > 2]
    assert zero_points and all(z.dtype == np.int8 and not z.any() for z in zero_points)
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)


def test_calibration_windows_are_evenly_spaced_and_deterministic():
    tokens = np.arange(100, dtype=np.uint16)
    windows = calibration_windows(tokens, 3, 10)
    assert windows.dtype == np.int64
    np.testing.assert_array_equal(windows[:, 0], [0, 45, 90])
    np.testing.assert_array_equal(windows[2], np.arange(90, 100))
    with pytest.raises(InputDataError, match="fewer than calibration_seq_len"):
        calibration_windows(tokens[:5], 3, 10)


def test_calibration_reader_batches_windows_and_rewinds():
    windows = np.arange(10 * 4, dtype=np.int64).reshape(10, 4)
    reader = TokenWindowReader(windows, batch_size=4)
    sizes = []
    while (batch := reader.get_next()) is not None:
        assert batch["attention_mask"].shape == batch["input_ids"].shape
        sizes.append(len(batch["input_ids"]))
    assert sizes == [4, 4, 2]
    reader.rewind()
    np.testing.assert_array_equal(reader.get_next()["input_ids"], windows[:4])


def test_shards_from_another_tokenizer_are_refused(tmp_path, onnx_dir):
    shards = tmp_path / "shards"
    writer = ShardWriter(shards, vocab_size=512, eos_id=0, tokenizer_sha256="0" * 64, shard_tokens=1000)
    writer.add_document("train", np.arange(200) % 512)
    writer.close()
    with pytest.raises(InputDataError, match="tokenizer 000000000000, but .* uses tokenizer"):
        quantize.run(CFG, onnx_dir, shards, tmp_path / "dynamic", tmp_path / "qdq")
    assert not (tmp_path / "dynamic").exists() and not (tmp_path / "qdq").exists()
