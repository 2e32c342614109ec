"""export_onnx: a tiny GPT-2 to an ONNX model directory, checked against PyTorch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from transformers import BertConfig, BertModel

from lmforge.config import ExportConfig
from lmforge.data.tokenizer import tokenizer_fingerprint
from lmforge.errors import InputDataError
from lmforge.export import onnx_export
from lmforge.export.onnx_export import LogitsOnly, ParityError, parity_cases
from lmforge.export.ort import OrtCausalLM
from lmforge.model.build import load_causal_lm


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("export") / "onnx"
    return out, onnx_export.run(ExportConfig(), tiny_model_dir, out)


def test_output_dir_follows_the_onnx_model_contract(exported, tiny_model_dir):
    out, _ = exported
    for name in ("model.onnx", "manifest.json", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (out / name).is_file(), name
    assert tokenizer_fingerprint(out) == tokenizer_fingerprint(tiny_model_dir)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kind"] == "onnx-model"
    assert manifest["exporter"] == "dynamo"
    assert manifest["opset"] == 18
    assert manifest["inputs"]["model"]["uri"] == str(tiny_model_dir)
    assert set(manifest["metrics"]) == {"parity_max_abs_diff", "onnx_size_mb", "export_seconds"}
    assert "model.onnx" in manifest["files"]


def test_graph_has_dynamic_int64_inputs_and_float_logits(exported):
    out, _ = exported
    graph = onnx.load(str(out / "model.onnx")).graph
    assert [i.name for i in graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in graph.output] == ["logits"]
    for tensor in graph.input:
        assert tensor.type.tensor_type.elem_type == onnx.TensorProto.INT64
        dims = tensor.type.tensor_type.shape.dim
        assert len(dims) == 2 and all(d.dim_param and not d.dim_value for d in dims)
    logits = graph.output[0].type.tensor_type
    assert logits.elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_param for d in logits.shape.dim[:2]] == [
        d.dim_param for d in graph.input[0].type.tensor_type.shape.dim
    ]
    assert logits.shape.dim[2].dim_value == 512


def test_ort_logits_match_pytorch_on_three_shapes_with_left_padding(exported, tiny_model_dir):
    out, _ = exported
    wrapper = LogitsOnly(load_causal_lm(tiny_model_dir))
    session = OrtCausalLM(out, threads=1)
    rng = np.random.default_rng(7)
    for batch, seq, pad in ((1, 5, 0), (3, 40, 0), (2, 33, 7)):
        ids = rng.integers(0, 512, size=(batch, seq), dtype=np.int64)
        mask = np.ones_like(ids)
        mask[1:, :pad] = 0
        with torch.no_grad():
            expected = wrapper(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
        actual = session.logits(ids, mask)
        assert actual.shape == (batch, seq, 512) and actual.dtype == np.float32
        keep = mask.astype(bool)
        assert np.max(np.abs(actual[keep] - expected[keep])) <= 1e-3


def test_metrics_report_parity_and_size(exported):
    out, result = exported
    assert 0 <= result.metrics["parity_max_abs_diff"] <= 1e-3
    assert result.metrics["onnx_size_mb"] == pytest.approx((out / "model.onnx").stat().st_size / 1e6)
    assert result.metrics["export_seconds"] > 0
    assert [case["shape"] for case in result.summary["parity"]] == [[1, 1], [1, 17], [2, 64]]
    assert result.summary["parity"][2]["padded"]


def test_parity_cases_are_deterministic_and_left_padded():
    first, second = parity_cases(512, 64), parity_cases(512, 64)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(first, second, strict=True))
    ids, mask = first[2]
    assert ids.shape == (2, 64) and ids.max() < 512
    assert mask[0].all() and not mask[1, :5].any() and mask[1, 5:].all()


def test_parity_above_tolerance_fails_and_leaves_no_output(exported, tiny_model_dir, tmp_path, monkeypatch):
    src, _ = exported

    def reuse_export(wrapper, example, path, opset):
        shutil.copy(src / "model.onnx", path)
        return "dynamo"

    monkeypatch.setattr(onnx_export, "_export", reuse_export)
    out = tmp_path / "onnx"
    with pytest.raises(ParityError, match="exceeds parity_tolerance"):
        onnx_export.run(ExportConfig(parity_tolerance=1e-12), tiny_model_dir, out)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_bert_model_dir_is_refused_with_its_path(tmp_path):
    model_dir = tmp_path / "bert"
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    BertModel(config).save_pretrained(model_dir)
    with pytest.raises(InputDataError, match=f"{model_dir}.*not a causal LM"):
        onnx_export.run(ExportConfig(), model_dir, tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


def test_model_dir_without_weights_is_refused_with_its_path(tmp_path, tiny_model_dir):
    model_dir = tmp_path / "no-weights"
    model_dir.mkdir()
    shutil.copy(tiny_model_dir / "config.json", model_dir)
    with pytest.raises(InputDataError, match=f"{model_dir}: no weights"):
        onnx_export.run(ExportConfig(), model_dir, tmp_path / "onnx")


def test_ort_model_refuses_missing_and_corrupt_files(tmp_path):
    with pytest.raises(InputDataError, match="ONNX model not found"):
        OrtCausalLM(tmp_path)
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"not a protobuf")
    with pytest.raises(InputDataError, match=f"{bad}: not a valid ONNX model"):
        OrtCausalLM(tmp_path)


def test_ort_model_defaults_mask_to_ones_and_reports_size(exported):
    out, _ = exported
    session = OrtCausalLM(out / "model.onnx")
    ids = np.arange(12, dtype=np.int64).reshape(2, 6)
    np.testing.assert_array_equal(session.logits(ids), session.logits(ids, np.ones_like(ids)))
    assert session.size_bytes == Path(out / "model.onnx").stat().st_size
    with pytest.raises(ValueError, match="2-D"):
        session.logits(ids[0])


def test_dynamo_failure_falls_back_to_torchscript_and_records_it(tiny_model_dir, tmp_path, monkeypatch, caplog):
    real_export = torch.onnx.export

    def dynamo_fails(*args, dynamo=True, **kwargs):
        if dynamo:
            raise RuntimeError("simulated dynamo failure")
        return real_export(*args, dynamo=False, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", dynamo_fails)
    out = tmp_path / "onnx"
    with caplog.at_level("WARNING", logger="lmforge.export"):
        result = onnx_export.run(ExportConfig(), tiny_model_dir, out)
    assert "simulated dynamo failure" in caplog.text and "TorchScript" in caplog.text
    assert result.summary["exporter"] == "torchscript"
    assert json.loads((out / "manifest.json").read_text())["exporter"] == "torchscript"
    assert result.metrics["parity_max_abs_diff"] <= 1e-3
