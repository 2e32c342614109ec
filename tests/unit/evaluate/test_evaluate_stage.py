"""The ``evaluate`` stage end to end on tiny real artifacts (PyTorch, ONNX FP32, ONNX INT8 dynamic)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lmforge.artifacts import read_manifest, write_manifest
from lmforge.config import GATE_CHECKS, EvaluateConfig, GateConfig, GenerationEvalConfig
from lmforge.config.evaluate import HarnessConfig
from lmforge.contracts import HISTORY_FILE
from lmforge.errors import InputDataError
from lmforge.evaluate import evaluate
from lmforge.formats.token_shards import TokenShards
from lmforge.metrics.perplexity import perplexity, torch_logits_fn
from lmforge.model.build import load_causal_lm
from lmforge.onnx_runtime import NO_PAST_FILE

pytestmark = pytest.mark.slow  # ONNX export of the fixture model plus a full evaluation: about a minute on 2 cores

CFG = EvaluateConfig(
    context=128,  # above the tiny model's 64 positions: the stage clamps it
    max_eval_tokens=600,
    latency_runs=2,
    generation=GenerationEvalConfig(max_prompts=6, max_new_tokens=6, batch_size=4, samples=3),
    harness=HarnessConfig(limit=4),
    gate=GateConfig(max_student_perplexity=1e4, max_int8_perplexity_delta=0.5, max_latency_ms=1e4),
)


def _model_copy(src: Path, dst: Path, history: dict | None, **manifest) -> Path:
    shutil.copytree(src, dst)
    if history is not None:
        (dst / HISTORY_FILE).write_text(json.dumps(history), encoding="utf-8")
    write_manifest(dst, "model", **manifest)
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
        str(out / NO_PAST_FILE),
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
def artifacts(tmp_path_factory, tiny_model_dir, qa_jsonl) -> dict[str, Path]:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = tmp_path_factory.mktemp("eval-inputs")
    teacher = _model_copy(
        tiny_model_dir,
        root / "teacher",
        {"step": [1, 2, 3], "train_loss": [6.3, 6.1, 5.9]},
        # what the LoRA stage records: the Q&A data and its held-out fraction
        inputs={"qa": {"uri": str(qa_jsonl), "kind": "qa_pairs"}},
        config={"heldout_fraction": 0.2},
    )
    student = _model_copy(
        tiny_model_dir,
        root / "student",
        {"step": [1, 2], "train_loss": [6.2, 6.0], "kd_loss": [1.0, 0.9], "eval_step": [2], "eval_loss": [6.1]},
    )
    fp32 = _export_onnx(tiny_model_dir, root / "onnx_fp32")
    int8 = root / "int8_dynamic"
    int8.mkdir()
    quantize_dynamic(fp32 / NO_PAST_FILE, int8 / NO_PAST_FILE, weight_type=QuantType.QInt8)
    shutil.copy(fp32 / "config.json", int8 / "config.json")
    write_manifest(int8, "onnx")
    engine = root / "engine"
    engine.mkdir()
    (engine / "status.json").write_text(json.dumps({"status": "skipped", "reason": "no GPU"}))
    return {"teacher": teacher, "student": student, "onnx_fp32": fp32, "int8_dynamic": int8, "engine": engine}


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, artifacts, tiny_shards_dir):
    out = tmp_path_factory.mktemp("eval") / "evaluation"
    result = evaluate.evaluate_models(
        CFG,
        shards_dir=tiny_shards_dir,
        models={"teacher": artifacts["teacher"], "student": artifacts["student"]},
        onnx_models={"onnx_fp32": artifacts["onnx_fp32"], "int8_dynamic": artifacts["int8_dynamic"]},
        engine_dir=artifacts["engine"],
        output_dir=out,
        release_root=str(tmp_path_factory.mktemp("empty-registry")),
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
    assert (results["context"], results["stride"]) == (64, 64)
    assert results["eval_bytes"] > results["eval_tokens"]  # several bytes per BPE token
    assert results["production"]["status"] == "none"

    # the packaged harness tasks ran on both PyTorch models, into results, metrics, report and summary
    harness = results["harness"]
    assert harness["status"] == "evaluated" and set(harness["scores"]) == {"teacher", "student"}
    assert (
        set(harness["tasks"]) == {"lmforge_qa_mc", "lmforge_cloze"}
        and harness["tasks"]["lmforge_qa_mc"]["documents"] == 4
    )
    acc = results["models"]["student"]["harness.lmforge_qa_mc.acc"]
    assert acc == harness["scores"]["student"]["lmforge_qa_mc"]["acc"] and 0 <= acc <= 1
    assert manifest["metrics"]["student_harness.lmforge_qa_mc.acc"] == acc
    page = (out / "report.html").read_text()
    assert "<h2>Standard evaluations</h2>" in page and "lmforge_qa_mc acc" in page
    assert "lmforge_cloze perplexity" in (out / "report.md").read_text()
    assert results["verdict"] and results["verdict"][0].startswith("teacher:")

    gen = results["generation"]
    assert gen["status"] == "evaluated" and gen["prompts"] == 6
    assert gen["qa_uri"].endswith("qa.jsonl")  # taken from the teacher's manifest
    assert (gen["heldout_fraction"], gen["heldout_fraction_source"]) == (0.2, "the LoRA stage's manifest")
    assert gen["bleu_signature"].startswith("nrefs:")
    assert len(gen["samples"]) == 3 and set(gen["samples"][0]["answers"]) == {"teacher", "student"}
    for name in ("teacher", "student"):
        entry = results["models"][name]
        for key in ("exact_match", "f1", "rouge_l"):
            assert 0.0 <= entry[key] <= 1.0
        assert 0.0 <= entry["bleu"] <= 100.0
    assert "exact_match" not in results["models"]["onnx_fp32"]

    html = (out / "report.html").read_text()
    assert html == result.html
    for heading in ("Summary", "Gate", "Model comparison", "Generation", "Loss curves", "Data", "TensorRT", "Method"):
        assert f"<h2>{heading}</h2>" in html
    assert "skipped: no GPU" in html and 'class="pass"' in html and "data:image/png;base64" in html
    assert "INT8 Q/DQ" in html.replace("<wbr>", "")  # absent models still get a row (<wbr>: break opportunities)
    assert "# lmforge evaluation: PASSED" in (out / "report.md").read_text()


def test_stage_result_metrics_and_summary(evaluated):
    _, result = evaluated
    for name in ("teacher", "student", "onnx_fp32", "int8_dynamic"):
        for metric in ("perplexity", "bits_per_byte", "size_mb", "p99_ms"):
            assert result.metrics[f"{name}_{metric}"] > 0
    for metric in ("exact_match", "f1", "bleu", "rouge_l"):
        assert f"student_{metric}" in result.metrics
    assert result.metrics["passed"] == 1.0
    assert result.summary["passed"] is True
    assert tuple(c["name"] for c in result.summary["checks"]) == GATE_CHECKS
    assert [row["model"] for row in result.summary["table"]][:7] == [
        "base",
        "teacher",
        "student",
        "onnx_fp32",
        "int8_dynamic",
        "int8_qdq",
        "tensorrt",
    ]


def test_onnx_and_pytorch_perplexities_agree(evaluated, tiny_model_dir, tiny_shards_dir):
    _, result = evaluated
    shards = TokenShards.open(tiny_shards_dir)
    expected = perplexity(
        torch_logits_fn(load_causal_lm(tiny_model_dir)),
        shards.tokens("val"),
        context=64,
        max_tokens=600,
        prefix=shards.eos_id,
    )
    assert result.metrics["student_perplexity"] == pytest.approx(expected.perplexity, rel=1e-6)
    assert result.metrics["onnx_fp32_perplexity"] == pytest.approx(expected.perplexity, rel=1e-3)
    assert result.metrics["onnx_fp32_bits_per_byte"] == pytest.approx(result.metrics["student_bits_per_byte"], rel=1e-3)


@pytest.mark.parametrize("stride", [64, 16])
def test_onnx_and_pytorch_agree_with_a_sliding_window(artifacts, tiny_model_dir, tiny_shards_dir, stride):
    from lmforge.metrics.perplexity import onnx_logits_fn
    from lmforge.onnx_runtime import OrtCausalLM

    tokens = TokenShards.open(tiny_shards_dir).tokens("val")
    kwargs = {"context": 64, "stride": stride, "max_tokens": 300}
    torch_ppl = perplexity(torch_logits_fn(load_causal_lm(tiny_model_dir)), tokens, **kwargs)
    onnx_ppl = perplexity(onnx_logits_fn(OrtCausalLM(artifacts["onnx_fp32"])), tokens, **kwargs)
    assert onnx_ppl.tokens == torch_ppl.tokens == 299
    assert onnx_ppl.perplexity == pytest.approx(torch_ppl.perplexity, rel=1e-3)


def test_failed_gate_is_reported_not_raised(tmp_path, artifacts, tiny_shards_dir):
    cfg = CFG.model_copy(update={"gate": GateConfig(max_student_perplexity=1.0), "latency_runs": 1})
    result = evaluate.evaluate_models(
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
    assert "'student' was not evaluated" not in reasons["student_exact_match"]
    assert "'int8_dynamic' was not evaluated" in reasons["int8_perplexity_delta"]
    assert json.loads((tmp_path / "evaluation" / "results.json").read_text())["passed"] is False
    assert "FAIL" in (tmp_path / "evaluation" / "report.md").read_text()


def test_engine_dir_without_status_is_refused(tmp_path, artifacts, tiny_shards_dir):
    (tmp_path / "engine").mkdir()
    with pytest.raises(InputDataError, match=r"no status\.json"):
        evaluate.evaluate_models(
            CFG,
            shards_dir=tiny_shards_dir,
            models={"student": artifacts["student"]},
            onnx_models={},
            engine_dir=tmp_path / "engine",
            output_dir=tmp_path / "evaluation",
        )
    assert not (tmp_path / "evaluation").exists()


def test_a_candidate_worse_than_production_fails_the_gate(tmp_path, artifacts, tiny_shards_dir):
    from lmforge.release.promote import promote

    registry = str(tmp_path / "registry")
    # production: a release whose student was far better (bits per byte 0.5) than a random model can be
    prod_eval = tmp_path / "prod-eval"
    prod_eval.mkdir()
    (prod_eval / "results.json").write_text(json.dumps({"passed": True, "gate": {"passed": True, "checks": []}}))
    write_manifest(prod_eval, "evaluation", metrics={"student_bits_per_byte": 0.5, "student_exact_match": 0.0})
    promote(
        model_name="tiny",
        release_root=registry,
        version="v1",
        artifacts={"student": artifacts["student"]},
        evaluation_dir=prod_eval,
    )
    cfg = CFG.model_copy(update={"latency_runs": 1, "generation": GenerationEvalConfig(enabled=False)})
    # no teacher and no generation here: the checks against the teacher are off, production's are the subject
    off = {"min_student_exact_match", "max_answer_loss_increase", "max_f1_drop", "max_empty_answers"}
    cfg = cfg.model_copy(update={"gate": cfg.gate.model_copy(update=dict.fromkeys(off))})
    result = evaluate.evaluate_models(
        cfg,
        shards_dir=tiny_shards_dir,
        models={"student": artifacts["student"]},
        onnx_models={"onnx_fp32": artifacts["onnx_fp32"], "int8_dynamic": artifacts["int8_dynamic"]},
        engine_dir=None,
        output_dir=tmp_path / "evaluation",
        release_root=registry,
        model_name="tiny",
    )
    failed = {c["name"]: c["reason"] for c in result.summary["checks"] if c["status"] == "fail"}
    assert set(failed) == {"bits_per_byte_vs_production", "exact_match_vs_production"}
    assert "vs production v1" in failed["bits_per_byte_vs_production"]
    assert "student.exact_match is missing" in failed["exact_match_vs_production"]  # generation was off
    assert result.summary["passed"] is False
    results = json.loads((tmp_path / "evaluation" / "results.json").read_text())
    assert results["production"]["version"] == "v1"
    assert results["generation"] == {"status": "skipped", "reason": "disabled in config"}
