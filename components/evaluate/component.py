"""KFP component: evaluate every model, write the report, decide the gate."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Markdown, Metrics, Model, Output

from components.images import image_for


@dsl.component(base_image=image_for("evaluate"), install_kfp_package=False)
def evaluate(
    shards: Input[Dataset],
    teacher: Input[Model],
    student: Input[Model],
    onnx_fp32: Input[Model],
    int8_dynamic: Input[Model],
    int8_qdq: Input[Model],
    engine: Input[Artifact],
    cleaned: Input[Dataset],
    evaluation: Output[Artifact],
    metrics: Output[Metrics],
    report: Output[HTML],
    summary: Output[Markdown],
    qa_uri: str = "",
    release_root: str = "",
    preset: str = "tiny-cpu",
    overrides: str = "{}",
    promote_overrides: str = "{}",
    production_fingerprint: str = "",
) -> bool:
    """Held-out perplexity, size and latency of teacher, student, ONNX FP32, INT8 and engine; gate decision.

    Args:
        shards: Token shards; the ``val`` split is the held-out text.
        teacher: Merged LoRA model (teacher).
        student: Distilled student.
        onnx_fp32: FP32 ONNX export of the student.
        int8_dynamic: Dynamic INT8 ONNX model.
        int8_qdq: Calibrated Q/DQ INT8 ONNX model.
        engine: TensorRT engine directory (or its ``skipped`` status).
        cleaned: Cleaned corpus; its stats feed the report's data summary.
        evaluation: results.json, report.html, report.md and manifest.
        metrics: Per-model perplexity, size, p99 latency and ``passed``.
        report: Self-contained HTML report.
        summary: Markdown summary for the Kubeflow UI.
        qa_uri: Q&A data; the held-out pairs LoRA never trained on are used for EM/F1/BLEU/ROUGE-L.
        release_root: Registry root; the candidate is compared with the release its ``latest.json`` names.
        preset: lmforge preset the stage config starts from.
        overrides: JSON object of EvaluateConfig fields, e.g. {"gate.max_student_perplexity": 50.0}.
        promote_overrides: The promote stage's overrides, for the release name to compare against.
        production_fingerprint: Fingerprint of that production release from ``preflight``; part of the cache key,
            so a run after a new release re-evaluates instead of reusing a gate decided against the old one.

    Returns:
        Whether every gate check passed (``promote`` runs only then).
    """
    from pathlib import Path

    from lmforge.component_io import publish, setup_logging
    from lmforge.config import resolve_stage_config
    from lmforge.evaluate import evaluate as stage

    setup_logging()
    evaluation.metadata["production_fingerprint"] = production_fingerprint
    cfg = resolve_stage_config("evaluate", preset, overrides)
    result = stage.run(
        cfg,
        shards_dir=Path(shards.path),
        models={"teacher": Path(teacher.path), "student": Path(student.path)},
        onnx_models={
            "onnx_fp32": Path(onnx_fp32.path),
            "int8_dynamic": Path(int8_dynamic.path),
            "int8_qdq": Path(int8_qdq.path),
        },
        engine_dir=Path(engine.path),
        output_dir=Path(evaluation.path),
        qa_uri=qa_uri or None,
        release_root=release_root or None,
        model_name=resolve_stage_config("promote", preset, promote_overrides).model_name,
        cleaned_dir=Path(cleaned.path),
    )
    markdown = (Path(evaluation.path) / "report.md").read_text(encoding="utf-8")
    publish(result, metrics=metrics, html=report, markdown=summary, markdown_text=markdown)
    return bool(result.summary["passed"])
