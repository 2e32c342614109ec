"""quantize_int8: dynamic INT8 for CPU and calibrated symmetric Q/DQ INT8 for TensorRT, each behind an
accuracy gate (held-out perplexity vs FP32 in ONNX Runtime)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper
from onnxruntime.quantization import CalibrationMethod
from onnxruntime.quantization.calibrate import TensorData, TensorsData

from lmforge.artifacts import write_manifest
from lmforge.config import ExportConfig, ModelConfig, QuantizeConfig
from lmforge.contracts import gate_decision, gate_result
from lmforge.data.tokenizer import tokenizer_fingerprint
from lmforge.errors import InputDataError
from lmforge.export import export_onnx, quantize_int8
from lmforge.export.quantize_int8 import (
    TokenWindowReader,
    calibration_windows,
    even_batch_size,
    nodes_touching,
    unsafe_tensors,
)
from lmforge.export.tied_embedding import find_tied_pairs, share_tied_embedding
from lmforge.formats.token_shards import ShardWriter, TokenShards
from lmforge.metrics.perplexity import onnx_logits_fn, perplexity
from lmforge.model.build import build_model, load_tokenizer, save_model_dir
from lmforge.onnx_runtime import NO_PAST_FILE, WITH_PAST_FILE, OrtCausalLM, OrtDecoderWithPast

# Wide enough that the int8 weights, not the fixed graph overhead, dominate the file size.
MODEL = ModelConfig(arch="gpt2", n_layer=2, n_head=2, n_embd=64, block_size=64)
CFG = QuantizeConfig(calibration_sequences=12, calibration_seq_len=32, gate_eval_tokens=2048)


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory, tiny_tokenizer_dir, tiny_shards_dir):
    """A briefly trained model (perplexity ~150 of 512): a random-init one predicts near-uniformly, so no
    quantization could hurt it; 300 steps are enough for it to rely on attention to earlier tokens."""
    tok = load_tokenizer(tiny_tokenizer_dir)
    model = build_model(MODEL, len(tok), eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, seed=0)
    tokens = torch.from_numpy(np.asarray(TokenShards.open(tiny_shards_dir).tokens("train")).astype(np.int64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(300):
        starts = torch.randint(0, len(tokens) - 32, (16,), generator=generator)
        batch = torch.stack([tokens[s : s + 32] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model_dir = save_model_dir(model, tok, tmp_path_factory.mktemp("model64"))
    write_manifest(model_dir, "model")
    out = tmp_path_factory.mktemp("export64") / "onnx"
    export_onnx.run(ExportConfig(), model=model_dir, onnx_model=out)
    return out


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, onnx_dir, tiny_shards_dir):
    root = tmp_path_factory.mktemp("quant")
    result = quantize_int8.run(
        CFG, onnx_model=onnx_dir, shards=tiny_shards_dir, int8_dynamic=root / "dynamic", int8_qdq=root / "qdq"
    )
    return root / "dynamic", root / "qdq", result


@pytest.fixture(scope="module")
def heldout(tiny_shards_dir):
    return np.asarray(TokenShards.open(tiny_shards_dir).tokens("val")[:2048]).astype(np.int64)


def test_both_int8_models_load_and_give_finite_logits(quantized):
    ids = np.random.default_rng(0).integers(0, 512, size=(2, 16), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    for model_dir in quantized[:2]:
        logits = OrtCausalLM(model_dir, threads=1).logits(ids, mask)
        assert logits.shape == (2, 16, 512) and logits.dtype == np.float32
        assert np.isfinite(logits).all()


def test_dynamic_model_is_at_most_0_3x_fp32_with_one_int8_vocabulary_table(quantized, onnx_dir):
    dynamic_dir, qdq_dir, result = quantized
    fp32 = OrtCausalLM(onnx_dir).size_bytes
    assert OrtCausalLM(dynamic_dir).size_bytes <= 0.3 * fp32
    assert OrtCausalLM(qdq_dir).size_bytes < fp32
    assert result.metrics["fp32_size_mb"] == pytest.approx(fp32 / 1e6)
    assert result.metrics["calibration_sequences"] == 12
    manifest = json.loads((dynamic_dir / "manifest.json").read_text())
    for graph in (NO_PAST_FILE, WITH_PAST_FILE):
        assert manifest["tied_embedding"][graph]["shared_tables"] == 1
        model = onnx.load(str(dynamic_dir / graph))
        vocab_tables = [i for i in model.graph.initializer if 512 in i.dims and 64 in i.dims]
        assert [onnx.TensorProto.DataType.Name(t.data_type) for t in vocab_tables] == ["INT8"]


def _run_with_output(model: onnx.ModelProto, extra_output: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run ``model`` (single-threaded, so two graphs doing the same arithmetic give the same bits) with one of its
    intermediate tensors added as an output."""
    probed = onnx.ModelProto()
    probed.CopyFrom(model)
    probed.graph.output.append(onnx.helper.make_tensor_value_info(extra_output, onnx.TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(probed.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_sharing_the_tied_table_moves_the_embedding_by_at_most_half_a_step_and_changes_nothing_else(
    tmp_path, onnx_dir, tiny_shards_dir
):
    """What the rewrite guarantees: each looked-up row is the head's int8 row dequantized, so it is within half a
    quantization step of the FP32 row, and the rest of the graph is untouched. How far the logits move is the
    model's sensitivity to that rounding, which the accuracy gate measures; no bound on it follows from the step."""
    cfg = CFG.model_copy(update={"share_tied_embedding": False})
    quantize_int8.run(
        cfg, onnx_model=onnx_dir, shards=tiny_shards_dir, int8_dynamic=tmp_path / "dynamic", int8_qdq=tmp_path / "qdq"
    )
    separate = onnx.load(str(tmp_path / "dynamic" / NO_PAST_FILE))
    shared = onnx.load(str(tmp_path / "dynamic" / NO_PAST_FILE))
    (pair,) = find_tied_pairs(separate)
    embedding, gather = pair.gather.output[0], pair.gather.name
    inits = {t.name: numpy_helper.to_array(t) for t in separate.graph.initializer}
    table, scale = inits[pair.fp32_table], inits[pair.scale].reshape(())
    head_rows = ((inits[pair.int8_table].astype(np.int32) - inits[pair.zero_point]).astype(np.float32) * scale).T

    facts = share_tied_embedding(shared)
    assert facts == {"shared_tables": 1, "bytes_removed": 512 * 64 * 4}
    onnx.checker.check_model(shared)
    assert share_tied_embedding(shared)["shared_tables"] == 0  # idempotent: nothing left to share
    # the graph before the rewrite, its lookup fed the rows the rewritten graph reads
    reference = onnx.ModelProto()
    reference.CopyFrom(separate)
    reference.graph.initializer.append(numpy_helper.from_array(head_rows, "head_rows"))
    next(node for node in reference.graph.node if node.name == gather).input[0] = "head_rows"

    ids = np.random.default_rng(3).integers(0, 512, size=(2, 24), dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.tile(np.arange(24), (2, 1))}
    before_logits, before_rows = _run_with_output(separate, embedding, feeds)
    after_logits, after_rows = _run_with_output(shared, embedding, feeds)
    reference_logits, reference_rows = _run_with_output(reference, embedding, feeds)
    # |dequantize(round(w / s)) - w| <= s / 2, plus float32 rounding of the product at the table's magnitude
    half_step = 0.5 * float(scale) + np.finfo(np.float32).eps * float(np.abs(table).max())
    assert 0 < np.max(np.abs(after_rows - before_rows)) <= half_step
    np.testing.assert_array_equal(after_rows, reference_rows)
    np.testing.assert_array_equal(after_logits, reference_logits)
    assert np.isfinite(after_logits).all() and not np.array_equal(after_logits, before_logits)


def test_an_untied_or_unquantized_head_is_left_alone(onnx_dir):
    fp32 = onnx.load(str(onnx_dir / NO_PAST_FILE))
    assert share_tied_embedding(fp32) == {"shared_tables": 0, "bytes_removed": 0}
    assert find_tied_pairs(fp32) == []


def test_outputs_follow_the_onnx_model_contract(quantized, onnx_dir):
    dynamic_dir, qdq_dir, _ = quantized
    for model_dir, kind in ((dynamic_dir, "dynamic-int8"), (qdq_dir, "qdq-int8")):
        for name in (NO_PAST_FILE, "manifest.json", "tokenizer.json", "tokenizer_config.json", "config.json"):
            assert (model_dir / name).is_file(), f"{model_dir.name}/{name}"
        assert tokenizer_fingerprint(model_dir) == tokenizer_fingerprint(onnx_dir)
        manifest = json.loads((model_dir / "manifest.json").read_text())
        assert manifest["kind"] == "onnx-model"
        assert manifest["quantization"] == kind
        assert manifest["inputs"]["onnx_model"]["kind"] == "onnx-model"
        graph = onnx.load(str(model_dir / NO_PAST_FILE)).graph
        assert [i.name for i in graph.input] == ["input_ids", "attention_mask", "position_ids"]
        assert [o.name for o in graph.output] == ["logits"]
        assert manifest["graphs"] == [NO_PAST_FILE, WITH_PAST_FILE]
        assert (model_dir / WITH_PAST_FILE).is_file()
    qdq = json.loads((qdq_dir / "manifest.json").read_text())
    assert qdq["calibrate_method"] == "minmax" and qdq["calibration_sequences"] == 12 and qdq["symmetric"]


def test_qdq_model_uses_symmetric_int8_scales_for_tensorrt(quantized):
    model = onnx.load(str(quantized[1] / NO_PAST_FILE))
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
        assert batch["attention_mask"].shape == batch["position_ids"].shape == batch["input_ids"].shape
        np.testing.assert_array_equal(batch["position_ids"][-1], np.arange(4))
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
        quantize_int8.run(
            CFG, onnx_model=onnx_dir, shards=shards, int8_dynamic=tmp_path / "dynamic", int8_qdq=tmp_path / "qdq"
        )
    assert not (tmp_path / "dynamic").exists() and not (tmp_path / "qdq").exists()


def test_default_int8_models_pass_the_accuracy_gate_within_the_goals(quantized):
    dynamic_dir, qdq_dir, result = quantized
    metrics = result.metrics
    assert metrics["fp32_perplexity"] < 300  # trained: far below the 512 of a uniform guess
    assert abs(metrics["dynamic_perplexity_delta"]) <= 0.01
    assert metrics["qdq_perplexity_delta"] <= 0.02
    assert metrics["dynamic_accepted"] == metrics["qdq_accepted"] == 1.0
    for model_dir in (dynamic_dir, qdq_dir):
        gate = json.loads((model_dir / "manifest.json").read_text())["accuracy_gate"]
        assert gate["accepted"] is True and gate["reason"].startswith("accepted: held-out perplexity")
        assert gate["max_perplexity_delta"] == 0.02 and gate["tokens"] == 2048
        assert gate_result(model_dir) == gate  # what tensorrt, evaluate and promote read back
    assert "INT8 quantization" in result.html and "accepted" in result.html


def test_gate_rejects_all_ops_minmax_and_records_why(tmp_path, onnx_dir, tiny_shards_dir):
    """Every op quantized with MinMax and no unsafe-node exclusion: the attention mask's fill value gets an int8
    scale, the causal mask collapses and perplexity rises by tens of percent."""
    bad = QuantizeConfig(
        calibration_sequences=8,
        calibration_seq_len=32,
        gate_eval_tokens=2048,
        op_types=["all"],
        calibrate_method="minmax",
        exclude_unsafe_nodes=False,
    )
    result = quantize_int8.run(
        bad, onnx_model=onnx_dir, shards=tiny_shards_dir, int8_dynamic=tmp_path / "dynamic", int8_qdq=tmp_path / "qdq"
    )
    assert result.metrics["qdq_accepted"] == 0.0 and result.metrics["qdq_perplexity_delta"] > 0.02
    assert result.metrics["dynamic_accepted"] == 1.0
    gate = json.loads((tmp_path / "qdq" / "manifest.json").read_text())["accuracy_gate"]
    assert gate["accepted"] is False
    assert (
        gate["reason"].startswith("rejected: held-out perplexity") and "> max_perplexity_delta +2.00%" in gate["reason"]
    )
    assert result.summary["accuracy_gate"]["qdq"] == gate
    assert "REJECTED" in result.html
    assert gate_result(tmp_path / "qdq") == gate


@pytest.mark.parametrize("method", ["minmax", "entropy", "percentile"])
def test_each_calibrator_yields_an_accurate_qdq_model_all_ops_included(
    method, tmp_path, onnx_dir, heldout, tiny_shards_dir
):
    """With every op quantized, the mask fill value is found, its nodes stay float and entropy/percentile
    calibration no longer fails (entropy: "Too many bins")."""
    cfg = QuantizeConfig(calibration_sequences=8, calibration_seq_len=32, calibrate_method=method, op_types=["all"])
    windows = calibration_windows(TokenShards.open(tiny_shards_dir).tokens("train"), 8, 32)
    src = onnx_dir / NO_PAST_FILE
    facts = quantize_int8.quantize_qdq(
        src, tmp_path / NO_PAST_FILE, TokenWindowReader(windows, 4), cfg, external=False, workdir=tmp_path / "w"
    )
    assert {n.split("_")[1] for n in facts["excluded_nodes"]} == {"Where", "Add", "Softmax"}
    assert facts["unsafe_tensors"]
    fp32 = perplexity(onnx_logits_fn(OrtCausalLM(src)), heldout, context=64).perplexity
    int8 = perplexity(onnx_logits_fn(OrtCausalLM(tmp_path / NO_PAST_FILE)), heldout, context=64).perplexity
    assert (int8 - fp32) / fp32 < 0.02


def test_quantized_cache_decoder_agrees_with_the_quantized_full_graph(quantized):
    dynamic_dir, qdq_dir, _ = quantized
    ids = np.random.default_rng(2).integers(0, 512, size=(2, 20), dtype=np.int64)
    for model_dir in (dynamic_dir, qdq_dir):
        full = OrtCausalLM(model_dir).logits(ids)
        decoder = OrtDecoderWithPast(model_dir)
        prefill, past = decoder.step(ids[:, :12], np.ones((2, 12), dtype=np.int64), decoder.empty_past(2))
        rest, _ = decoder.step(ids[:, 12:], np.ones((2, 20), dtype=np.int64), past)
        cached = np.concatenate([prefill, rest], axis=1)
        assert np.isfinite(cached).all()
        assert np.mean(cached.argmax(-1) == full.argmax(-1)) >= 0.9
        tokens = decoder.generate(ids[:, :5], max_new_tokens=8)
        assert tokens.shape == (2, 8)


def test_gate_decision_is_relative_and_says_why():
    ok = gate_decision(100.0, 101.5, 0.02)
    assert ok["accepted"] and ok["perplexity_delta"] == pytest.approx(0.015)
    assert (
        ok["reason"] == "accepted: held-out perplexity 101.5 vs FP32 100: delta +1.50% <= max_perplexity_delta +2.00%"
    )
    bad = gate_decision(100.0, 103.0, 0.02)
    assert not bad["accepted"] and "delta +3.00% > max_perplexity_delta +2.00%" in bad["reason"]
    assert gate_decision(100.0, 90.0, 0.0)["accepted"]  # better than FP32 passes
    assert not gate_decision(100.0, float("nan"), 0.02)["accepted"]


def test_gate_result_accepts_fp32_reads_the_int8_record_and_refuses_an_ungated_int8(tmp_path):
    def model_dir(name, **extra):
        root = tmp_path / name
        root.mkdir()
        write_manifest(root, "onnx-model", extra=extra)
        return root

    fp32 = model_dir("fp32", quantization="none")
    rejected = model_dir("int8_dynamic", quantization="dynamic-int8", accuracy_gate={"accepted": False, "reason": "r1"})
    accepted = model_dir("int8_qdq", quantization="qdq-int8", accuracy_gate={"accepted": True, "reason": "ok"})
    ungated = model_dir("old", quantization="qdq-int8")
    assert gate_result(fp32) == {"accepted": True, "reason": "FP32 model: not quantized, nothing to gate"}
    assert gate_result(rejected) == {"accepted": False, "reason": "r1"}
    assert gate_result(accepted) == {"accepted": True, "reason": "ok"}
    assert gate_result(ungated) == {"accepted": False, "reason": f"{ungated}: manifest has no accuracy-gate result"}


def test_unsafe_tensors_are_non_finite_or_beyond_the_limit_and_their_nodes_found(tmp_path):
    ranges = TensorsData(
        CalibrationMethod.MinMax,
        {
            "ok": TensorData(lowest=np.float32(-3.0), highest=np.float32(3.0)),
            "fill": TensorData(lowest=np.float32(-3.4e38), highest=np.float32(0.0)),
            "inf": TensorData(lowest=np.float32(-np.inf), highest=np.float32(1.0)),
        },
    )
    assert unsafe_tensors(ranges, 1e6) == {"fill", "inf"}
    assert unsafe_tensors(ranges, 1e39) == {"inf"}
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Add", ["x", "fill"], ["scores"], name="add"),
            onnx.helper.make_node("Softmax", ["scores"], ["p"], name="softmax"),
            onnx.helper.make_node("MatMul", ["p", "x"], ["y"], name="matmul"),
        ],
        "g",
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2, 2]) for n in ("x", "fill")],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 2])],
    )
    onnx.save(onnx.helper.make_model(graph), str(tmp_path / "g.onnx"))
    assert nodes_touching(tmp_path / "g.onnx", {"fill"}, None) == ["add"]
    assert nodes_touching(tmp_path / "g.onnx", {"scores"}, None) == ["add", "softmax"]
    assert nodes_touching(tmp_path / "g.onnx", {"scores"}, ["MatMul"]) == []


def test_even_batch_size_divides_the_calibration_count():
    assert [even_batch_size(n) for n in (128, 12, 7, 1, 30)] == [8, 6, 7, 1, 6]


def test_the_cache_graph_is_quantized_only_when_the_directory_has_one(tmp_path):
    (tmp_path / NO_PAST_FILE).write_bytes(b"")
    assert quantize_int8.model_graphs(tmp_path) == [NO_PAST_FILE]
    (tmp_path / WITH_PAST_FILE).write_bytes(b"")
    assert quantize_int8.model_graphs(tmp_path) == [NO_PAST_FILE, WITH_PAST_FILE]


def test_gate_metrics_name_each_models_perplexity_delta_and_verdict():
    gates = {
        "dynamic": {"perplexity": 101.0, "perplexity_delta": 0.01, "accepted": True, "reason": "accepted"},
        "qdq": {"perplexity": 140.0, "perplexity_delta": 0.4, "accepted": False, "reason": "rejected"},
    }
    assert quantize_int8.gate_metrics(gates) == {
        "dynamic_perplexity": 101.0,
        "dynamic_perplexity_delta": 0.01,
        "dynamic_accepted": 1.0,
        "qdq_perplexity": 140.0,
        "qdq_perplexity_delta": 0.4,
        "qdq_accepted": 0.0,
    }
