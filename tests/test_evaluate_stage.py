"""The ``evaluate`` stage end to end on tiny real artifacts (PyTorch, ONNX FP32, ONNX INT8 dynamic)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lmforge.artifacts import read_manifest, write_manifest
from lmforge.config import EvaluateConfig, GateConfig
from lmforge.data.shards import TokenShards
from lmforge.errors import InputDataError
from lmforge.evaluate import evaluate
from lmforge.evaluate.perplexity import perplexity, torch_logits_fn
from lmforge.model.build import HISTORY_FILE, load_causal_lm

CFG = EvaluateConfig(
    context=128,  # above the tiny model's 64 positions: the stage clamps it
    max_eval_tokens=600,
    latency_runs=2,
    gate=GateConfig(max_student_perplexity=1e4, max_int8_perplexity_delta=0.5, max_latency_ms=1e4),
)


def _model_copy(src: Path, dst: Path, history: dict | None) -> Path:
    shutil.copytree(src, dst)
    if history is not None:
        (dst / HISTORY_FILE).write_text(json.dumps(history), encoding="utf-8")
    write_manifest(dst, "model")
    return dst


def _export_onnx(model_dir: Path, out: Path) -> Path:
    """A logits-only ONNX directory (the export contract: input_ids/attention_mask -> logits)."""

    class LogitsOnly(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    out.mkdir()
    ids = torch.zeros((2, 8), dtype=torch.int64)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=64)
    torch.onnx.export(
        LogitsOnly(load_causal_lm(model_dir)).eval(),
        (ids, torch.ones_like(ids)),
        str(out / "model.onnx"),
        input_names=["input_ids", "attention_mask"],
        output_names=["logits"],
        dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}),
        opset_version=18,
        dynamo=True,
        external_data=False,
        verbose=False,
    )
    shutil.copy(model_dir / "config.json", out / "config.json")
    write_manifest(out, "onnx")
    return out


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = tmp_path_factory.mktemp("eval-inputs")
    teacher = _model_copy(tiny_model_dir, root / "teacher", {"step": [1, 2, 3], "train_loss": [6.3, 6.1, 5.9]})
    student = _model_copy(
        tiny_model_dir,
        root / "student",
        {"step": [1, 2], "train_loss": [6.2, 6.0], "kd_loss": [1.0, 0.9], "eval_step": [2], "eval_loss": [6.1]},
    )
    fp32 = _export_onnx(tiny_model_dir, root / "onnx_fp32")
    int8 = root / "int8_dynamic"
    int8.mkdir()
    quantize_dynamic(fp32 / "model.onnx", int8 / "model.onnx", weight_type=QuantType.QInt8)
    shutil.copy(fp32 / "config.json", int8 / "config.json")
    write_manifest(int8, "onnx")
    engine = root / "engine"
    engine.mkdir()
    (engine / "status.json").write_text(json.dumps({"status": "skipped", "reason": "no GPU"}))
    return {"teacher": teacher, "student": student, "onnx_fp32": fp32, "int8_dynamic": int8, "engine": engine}


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, artifacts, tiny_shards_dir):
    out = tmp_path_factory.mktemp("eval") / "evaluation"
    result = evaluate.run(
        CFG,
        shards_dir=tiny_shards_dir,
        models={"teacher": artifacts["teacher"], "student": artifacts["student"]},
        onnx_models={"onnx_fp32": artifacts["onnx_fp32"], "int8_dynamic": artifacts["int8_dynamic"]},
        engine_dir=artifacts["engine"],
        output_dir=out,
    )
    return out, result


def test_stage_writes_report_results_and_manifest(evaluated):
    out, result = evaluated
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "report.html", "report.md", "results.json"]
    manifest = read_manifest(out, verify=True)
    assert manifest["kind"] == "evaluation" and manifest["passed"] is True
    assert manifest["inputs"]["student"]["kind"] == "model" and manifest["inputs"]["student"]["fingerprint"]

    results = json.loads((out / "results.json").read_text())
    assert results["passed"] is True and results["gate"]["passed"] is True
    assert results["context"] == 64  # clamped to the model's n_positions
    assert set(results["models"]) == {"teacher", "student", "onnx_fp32", "int8_dynamic"}
    assert results["served_model"] == "int8_dynamic"
    assert results["tensorrt"] == {"status": "skipped", "reason": "no GPU"}
    assert set(results["models"]["student"]["latency"]) == {"1", "8"}

    html = (out / "report.html").read_text()
    assert html == result.html
    for heading in ("Summary", "Gate", "Model comparison", "Loss curves", "TensorRT", "Method"):
        assert f"<h2>{heading}</h2>" in html
    assert "skipped: no GPU" in html and 'class="pass"' in html and "data:image/png;base64" in html
    assert "INT8 Q/DQ" in html  # absent models still get a row
    assert "# lmforge evaluation: PASSED" in (out / "report.md").read_text()


def test_stage_result_metrics_and_summary(evaluated):
    _, result = evaluated
    for name in ("teacher", "student", "onnx_fp32", "int8_dynamic"):
        for metric in ("perplexity", "size_mb", "p99_ms"):
            assert result.metrics[f"{name}_{metric}"] > 0
    assert result.metrics["passed"] == 1.0
    assert result.summary["passed"] is True
    assert [c["name"] for c in result.summary["checks"]] == [
        "student_perplexity",
        "int8_perplexity_delta",
        "served_p99_latency_ms",
    ]
    assert [row["model"] for row in result.summary["table"]][:6] == [
        "teacher",
        "student",
        "onnx_fp32",
        "int8_dynamic",
        "int8_qdq",
        "tensorrt",
    ]


def test_onnx_and_pytorch_perplexities_agree(evaluated, tiny_model_dir, tiny_shards_dir):
    _, result = evaluated
    tokens = TokenShards.open(tiny_shards_dir).tokens("val")
    expected = perplexity(torch_logits_fn(load_causal_lm(tiny_model_dir)), tokens, context=64, max_tokens=600)
    assert result.metrics["student_perplexity"] == pytest.approx(expected.perplexity, rel=1e-6)
    assert result.metrics["onnx_fp32_perplexity"] == pytest.approx(expected.perplexity, rel=1e-4)


def test_failed_gate_is_reported_not_raised(tmp_path, artifacts, tiny_shards_dir):
    cfg = CFG.model_copy(update={"gate": GateConfig(max_student_perplexity=1.0), "latency_runs": 1})
    result = evaluate.run(
        cfg,
        shards_dir=tiny_shards_dir,
        models={"student": artifacts["student"]},
        onnx_models={},
        engine_dir=None,
        output_dir=tmp_path / "evaluation",
    )
    assert result.metrics["passed"] == 0.0 and result.summary["passed"] is False
    reasons = {c["name"]: c["reason"] for c in result.summary["checks"]}
    assert "too high" in reasons["student_perplexity"]
    assert "'int8_dynamic' was not evaluated" in reasons["int8_perplexity_delta"]
    assert json.loads((tmp_path / "evaluation" / "results.json").read_text())["passed"] is False
    assert "FAIL" in (tmp_path / "evaluation" / "report.md").read_text()


def test_engine_dir_without_status_is_refused(tmp_path, artifacts, tiny_shards_dir):
    (tmp_path / "engine").mkdir()
    with pytest.raises(InputDataError, match=r"no status\.json"):
        evaluate.run(
            CFG,
            shards_dir=tiny_shards_dir,
            models={"student": artifacts["student"]},
            onnx_models={},
            engine_dir=tmp_path / "engine",
            output_dir=tmp_path / "evaluation",
        )
    assert not (tmp_path / "evaluation").exists()
