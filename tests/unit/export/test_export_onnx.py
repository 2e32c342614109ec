"""export_onnx: a small GPT-2 to an ONNX model directory (with and without KV cache), checked against PyTorch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from transformers import BertConfig, BertModel

from lmforge.artifacts import write_manifest
from lmforge.config import ExportConfig
from lmforge.data.tokenizer import tokenizer_fingerprint
from lmforge.errors import InputDataError
from lmforge.export import export_onnx
from lmforge.export.export_onnx import DecoderWithPast, LogitsOnly, ParityError, parity_cases
from lmforge.model.build import load_causal_lm, load_tokenizer, save_model_dir
from lmforge.onnx_runtime import NO_PAST_FILE, WITH_PAST_FILE, OrtCausalLM, OrtDecoderWithPast, external_data_files

VOCAB = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny GPT-2 with its weight matrices scaled by 8: sharper logits, so greedy decoding changes token
    often instead of repeating one (a random-init model at HF scale does), and a cache bug shows."""
    model = load_causal_lm(tiny_model_dir)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.mul_(8.0)
    out = save_model_dir(model, load_tokenizer(tiny_model_dir), tmp_path_factory.mktemp("sharp-model"))
    write_manifest(out, "model")
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory, model_dir):
    out = tmp_path_factory.mktemp("export") / "onnx"
    return out, export_onnx.run(ExportConfig(), model=model_dir, onnx_model=out)


def _left_padded(rng, lengths, pad_id):
    longest = max(lengths)
    ids = np.full((len(lengths), longest), pad_id, dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, longest - n :] = rng.integers(2, VOCAB, size=n)
        mask[row, longest - n :] = 1
    return ids, mask


def _generate_positions(mask: np.ndarray, seq: int) -> torch.Tensor:
    """Position ids of the last ``seq`` tokens as transformers derives them in ``generate``
    (``GenerationMixin._prepare_position_ids_for_generation``, transformers 5), computed here in torch."""
    attention_mask = torch.from_numpy(mask)
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    return positions[:, -seq:]


def test_output_dir_follows_the_onnx_model_contract(exported, model_dir):
    out, _ = exported
    for name in (
        NO_PAST_FILE,
        WITH_PAST_FILE,
        "manifest.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "config.json",
    ):
        assert (out / name).is_file(), name
    assert tokenizer_fingerprint(out) == tokenizer_fingerprint(model_dir)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kind"] == "onnx-model"
    assert manifest["exporter"] == "dynamo"
    assert manifest["opset"] == 18
    assert manifest["inputs"]["model"]["uri"] == str(model_dir)
    assert set(manifest["metrics"]) == {
        "parity_max_abs_diff",
        "onnx_size_mb",
        "with_past_parity_max_abs_diff",
        "with_past_size_mb",
        "export_seconds",
    }
    assert {NO_PAST_FILE, WITH_PAST_FILE} <= set(manifest["files"])
    past = manifest["with_past"]
    assert (past["file"], past["exporter"], past["layers"], past["kv_heads"], past["head_dim"]) == (
        WITH_PAST_FILE,
        "dynamo",
        2,
        2,
        16,
    )


def test_graph_has_dynamic_int64_inputs_and_float_logits(exported):
    out, _ = exported
    graph = onnx.load(str(out / NO_PAST_FILE)).graph
    assert [i.name for i in graph.input] == ["input_ids", "attention_mask", "position_ids"]
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


def test_ort_logits_match_pytorch_on_three_shapes_with_left_padding(exported, model_dir):
    out, _ = exported
    wrapper = LogitsOnly(load_causal_lm(model_dir))
    session = OrtCausalLM(out, threads=1)
    rng = np.random.default_rng(7)
    for batch, seq, pad in ((1, 5, 0), (3, 40, 0), (2, 33, 7)):
        ids = rng.integers(0, 512, size=(batch, seq), dtype=np.int64)
        mask = np.ones_like(ids)
        mask[1:, :pad] = 0
        with torch.no_grad():
            expected = wrapper(torch.from_numpy(ids), torch.from_numpy(mask), _generate_positions(mask, seq)).numpy()
        actual = session.logits(ids, mask)
        assert actual.shape == (batch, seq, 512) and actual.dtype == np.float32
        keep = mask.astype(bool)
        assert np.max(np.abs(actual[keep] - expected[keep])) <= 1e-3


def test_metrics_report_parity_and_size(exported):
    out, result = exported
    assert 0 <= result.metrics["parity_max_abs_diff"] <= 1e-3
    assert result.metrics["onnx_size_mb"] == pytest.approx((out / NO_PAST_FILE).stat().st_size / 1e6)
    assert result.metrics["export_seconds"] > 0
    assert [case["shape"] for case in result.summary["parity"]] == [[1, 1], [1, 17], [2, 64]]
    assert result.summary["parity"][2]["padded"]


def test_parity_cases_are_deterministic_and_left_padded():
    first, second = parity_cases(512, 64), parity_cases(512, 64)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(first, second, strict=True))
    ids, mask = first[2]
    assert ids.shape == (2, 64) and ids.max() < 512
    assert mask[0].all() and not mask[1, :5].any() and mask[1, 5:].all()


def test_parity_above_tolerance_fails_and_leaves_no_output(exported, model_dir, tmp_path, monkeypatch):
    src, _ = exported

    def reuse_export(wrapper, example, path, opset, spec):
        shutil.copy(src / path.name, path)
        return "dynamo"

    monkeypatch.setattr(export_onnx, "_export", reuse_export)
    out = tmp_path / "onnx"
    with pytest.raises(ParityError, match="exceeds parity_tolerance"):
        export_onnx.run(ExportConfig(parity_tolerance=1e-12), model=model_dir, onnx_model=out)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_bert_model_dir_is_refused_with_its_path(tmp_path):
    model_dir = tmp_path / "bert"
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    BertModel(config).save_pretrained(model_dir)
    with pytest.raises(InputDataError, match=f"{model_dir}.*not a causal LM"):
        export_onnx.run(ExportConfig(), model=model_dir, onnx_model=tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


def test_model_dir_without_weights_is_refused_with_its_path(tmp_path, tiny_model_dir):
    model_dir = tmp_path / "no-weights"
    model_dir.mkdir()
    shutil.copy(tiny_model_dir / "config.json", model_dir)
    with pytest.raises(InputDataError, match=f"{model_dir}: no weights"):
        export_onnx.run(ExportConfig(), model=model_dir, onnx_model=tmp_path / "onnx")


def test_ort_model_refuses_missing_and_corrupt_files(tmp_path):
    with pytest.raises(InputDataError, match="ONNX model not found"):
        OrtCausalLM(tmp_path)
    bad = tmp_path / NO_PAST_FILE
    bad.write_bytes(b"not a protobuf")
    with pytest.raises(InputDataError, match=f"{bad}: not a valid ONNX model"):
        OrtCausalLM(tmp_path)


def test_ort_model_defaults_mask_to_ones_and_reports_size(exported):
    out, _ = exported
    session = OrtCausalLM(out / NO_PAST_FILE)
    ids = np.arange(12, dtype=np.int64).reshape(2, 6)
    np.testing.assert_array_equal(session.logits(ids), session.logits(ids, np.ones_like(ids)))
    assert session.size_bytes == Path(out / NO_PAST_FILE).stat().st_size
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
        result = export_onnx.run(ExportConfig(), model=tiny_model_dir, onnx_model=out)
    assert "simulated dynamo failure" in caplog.text and "TorchScript" in caplog.text
    assert result.summary["exporter"] == "torchscript"
    assert result.summary["with_past"]["exporter"] == "torchscript"
    assert json.loads((out / "manifest.json").read_text())["exporter"] == "torchscript"
    assert result.metrics["parity_max_abs_diff"] <= 1e-3
    assert result.metrics["with_past_parity_max_abs_diff"] <= 1e-3


def test_left_padded_row_gets_the_logits_of_the_unpadded_sequence(exported):
    """Position ids come from the mask: padding on the left must not shift the real tokens' positions."""
    out, _ = exported
    session = OrtCausalLM(out, threads=1)
    ids, mask = _left_padded(np.random.default_rng(11), [20, 13], pad_id=1)
    padded = session.logits(ids, mask)
    alone = session.logits(ids[1:, 7:])
    np.testing.assert_allclose(padded[1, 7:], alone[0], atol=1e-4)


def test_with_past_graph_has_dynamic_batch_sequence_and_past(exported):
    out, _ = exported
    graph = onnx.load(str(out / WITH_PAST_FILE)).graph
    names = [i.name for i in graph.input]
    assert names[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert names[3:] == [f"past_key_values.{i}.{kv}" for i in range(2) for kv in ("key", "value")]
    assert [o.name for o in graph.output] == ["logits"] + [
        f"present.{i}.{kv}" for i in range(2) for kv in ("key", "value")
    ]
    ids_dims, position_dims = (graph.input[i].type.tensor_type.shape.dim for i in (0, 2))
    assert graph.input[2].type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert [d.dim_param for d in position_dims] == [d.dim_param for d in ids_dims]
    for tensor in graph.input[3:]:
        dims = tensor.type.tensor_type.shape.dim
        assert dims[0].dim_param and dims[2].dim_param and (dims[1].dim_value, dims[3].dim_value) == (2, 16)
    mask_dims = graph.input[1].type.tensor_type.shape.dim
    assert mask_dims[1].dim_param and mask_dims[1].dim_param != graph.input[0].type.tensor_type.shape.dim[1].dim_param


def test_with_past_matches_pytorch_from_an_empty_past_through_decode_steps(exported, model_dir):
    out, result = exported
    assert [(c["shape"], c["past"]) for c in result.summary["with_past"]["parity"]] == [
        ([2, 12], 0),
        ([2, 1], 12),
        ([2, 4], 13),
    ]
    assert result.metrics["with_past_parity_max_abs_diff"] <= 1e-3
    # Independently of the stage's own check: an empty past, then 3 shapes, against transformers' cache.
    model = load_causal_lm(model_dir)
    decoder = DecoderWithPast(model, 2)
    session = OrtDecoderWithPast(out, threads=1)
    ids, mask = _left_padded(np.random.default_rng(5), [9, 4, 6], pad_id=1)
    past = session.empty_past(3)
    torch_past = [torch.from_numpy(p) for p in past]
    for new in (ids, ids[:, -1:], ids[:, :5]):
        mask = mask if new is ids else np.concatenate([mask, np.ones_like(new)], axis=1)
        logits, past = session.step(new, mask, past)
        with torch.no_grad():
            positions = _generate_positions(mask, new.shape[1])
            expected, *torch_past = decoder(torch.from_numpy(new), torch.from_numpy(mask), positions, torch_past)
        keep = mask[:, -new.shape[1] :].astype(bool)
        assert np.max(np.abs(logits[keep] - expected.numpy()[keep])) <= 1e-3
        assert past[0].shape == (3, 2, mask.shape[1], 16)


def test_greedy_generation_with_the_cache_equals_transformers_for_five_prompts(exported, model_dir):
    out, _ = exported
    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir)
    ids, mask = _left_padded(np.random.default_rng(3), [3, 9, 5, 12, 1], pad_id=tok.pad_token_id)
    with torch.no_grad():
        expected = model.generate(
            torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )[:, ids.shape[1] :].numpy()
    decoder = OrtDecoderWithPast(out, threads=1)
    kwargs = {"max_new_tokens": 32, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    generated = decoder.generate(ids, mask, **kwargs)
    assert generated.shape == (5, 32)
    np.testing.assert_array_equal(generated, expected)
    assert min(len(set(row)) for row in generated.tolist()) >= 3  # the prompts really steer the decoding
    for row in range(5):  # and a prompt decoded alone gives what it gave left-padded in the batch
        alone = decoder.generate(ids[row : row + 1, mask[row].argmax() :], **kwargs)
        np.testing.assert_array_equal(alone[0], generated[row])


@pytest.mark.slow
def test_weights_over_the_protobuf_limit_go_to_external_data(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(export_onnx, "EXTERNAL_DATA_BYTES", 0)  # every model counts as "over 2 GB"
    out = tmp_path / "onnx"
    result = export_onnx.run(ExportConfig(), model=model_dir, onnx_model=out)
    for name in (NO_PAST_FILE, WITH_PAST_FILE):
        data = external_data_files(out / name)
        assert data and all(f.is_file() for f in data), name
        assert {f.name for f in data} <= set(json.loads((out / "manifest.json").read_text())["files"])
    session = OrtCausalLM(out)
    assert session.size_bytes > (out / NO_PAST_FILE).stat().st_size
    assert result.metrics["onnx_size_mb"] == pytest.approx(session.size_bytes / 1e6)
    assert result.metrics["parity_max_abs_diff"] <= 1e-3 and result.metrics["with_past_parity_max_abs_diff"] <= 1e-3


def test_ort_decoder_refuses_a_graph_without_a_cache(exported):
    out, _ = exported
    with pytest.raises(InputDataError, match="not a decoder with past_key_values"):
        OrtDecoderWithPast(out / NO_PAST_FILE)
    with pytest.raises(InputDataError, match="decoder with KV cache not found"):
        OrtDecoderWithPast(out / "missing")
