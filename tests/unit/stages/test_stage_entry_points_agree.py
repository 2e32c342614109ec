"""The KFP component and ``lmforge stage`` run the same registry entry, so they make the same things: the same
release layout (the engine once landed under ``tensorrt/`` from the pipeline and under ``engine/`` from the CLI)
and the same gate baseline (the CLI once compared against a release of another name)."""

from __future__ import annotations

import json
from pathlib import Path

from kfp import dsl
from typer.testing import CliRunner

from lmforge.artifacts import write_manifest
from lmforge.cli import application
from lmforge.release.promote import promote
from lmforge_kfp.components import load_component

runner = CliRunner()
NAME_V1 = ("--io=model_name=support-bot", "--io=version=v1")
ARTIFACT_KINDS = {
    "student": "model",
    "onnx_fp32": "onnx-model",
    "int8_dynamic": "onnx-model",
    "int8_qdq": "onnx-model",
    "engine": "tensorrt-engine",
}


def _artifact(root: Path, kind: str) -> Path:
    root.mkdir(parents=True)
    (root / "weights.bin").write_bytes(kind.encode())
    if kind == "tensorrt-engine":
        (root / "status.json").write_text(json.dumps({"status": "skipped", "reason": "no GPU"}))
    write_manifest(root, kind)
    return root


def _evaluation(root: Path) -> Path:
    root.mkdir(parents=True)
    gate = {"passed": True, "checks": [{"name": "student_perplexity", "passed": True, "reason": "ok"}]}
    (root / "results.json").write_text(json.dumps({"passed": True, "gate": gate, "production": {"status": "none"}}))
    write_manifest(root, "evaluation", metrics={"passed": 1.0})
    return root


def _kfp(kind: str, path: Path, cls=dsl.Artifact) -> dsl.Artifact:
    return cls(name=path.name, uri=str(path), metadata={})


def test_a_release_from_the_pipeline_and_from_the_cli_has_the_same_layout(tmp_path):
    inputs = {name: _artifact(tmp_path / "in" / name, kind) for name, kind in ARTIFACT_KINDS.items()}
    evaluation = _evaluation(tmp_path / "in" / "evaluation")
    io = [f"--io={name}={path}" for name, path in inputs.items()]
    cli_root = tmp_path / "cli"
    result = runner.invoke(
        application(),
        ["stage", "promote", *io, f"--io=evaluation={evaluation}", f"--io=release_root={cli_root}", *NAME_V1],
    )
    assert result.exit_code == 0, result.output

    kfp_root = tmp_path / "kfp"
    load_component("promote").python_func(
        **{name: _kfp(name, path) for name, path in inputs.items()},
        evaluation=_kfp("evaluation", evaluation),
        metrics=dsl.Metrics(name="metrics", uri=str(tmp_path / "metrics"), metadata={}),
        release_root=str(kfp_root),
        model_name="support-bot",
        version="v1",
    )
    layout = {
        root: sorted(p.name for p in (root / "models" / "support-bot" / "v1").iterdir())
        for root in (cli_root, kfp_root)
    }
    assert layout[cli_root] == layout[kfp_root]
    assert "engine" in layout[cli_root] and "tensorrt" not in layout[cli_root]


def test_evaluate_from_the_pipeline_and_from_the_cli_compare_against_the_same_production_release(
    tmp_path, tiny_model_dir, tiny_shards_dir
):
    registry = tmp_path / "registry"
    promote(
        model_name="support-bot",
        release_root=str(registry),
        version="v1",
        artifacts={"student": tiny_model_dir},
        evaluation_dir=_evaluation(tmp_path / "prod-eval"),
    )
    overrides = {"generation.enabled": False, "latency_runs": 1, "context": 32, "max_eval_tokens": 256}
    cli_out = tmp_path / "cli-eval"
    result = runner.invoke(
        application(),
        ["stage", "evaluate", f"--io=shards={tiny_shards_dir}", f"--io=student={tiny_model_dir}"]
        + [f"--io=evaluation={cli_out}", f"--io=release_root={registry}", "--io=model_name=support-bot"]
        + [f"--set=evaluate.{key}={json.dumps(value)}" for key, value in overrides.items()],
    )
    assert result.exit_code == 0, result.output

    kfp_out = tmp_path / "kfp-eval"
    load_component("evaluate").python_func(
        shards=_kfp("shards", tiny_shards_dir, dsl.Dataset),
        student=_kfp("student", tiny_model_dir, dsl.Model),
        evaluation=_kfp("evaluation", kfp_out),
        metrics=dsl.Metrics(name="metrics", uri=str(tmp_path / "metrics"), metadata={}),
        report=dsl.HTML(name="report", uri=str(tmp_path / "report.html"), metadata={}),
        summary=dsl.Markdown(name="summary", uri=str(tmp_path / "summary.md"), metadata={}),
        release_root=str(registry),
        model_name="support-bot",
        overrides=json.dumps(overrides),
    )
    baselines = [json.loads((out / "results.json").read_text())["production"] for out in (cli_out, kfp_out)]
    assert baselines[0]["status"] == "found" and baselines[0]["version"] == "v1"
    assert baselines[0]["fingerprint"] == baselines[1]["fingerprint"]
