"""KFP component: publish a release to the model registry (only after the gate passed)."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Model

from components.images import image_for


@dsl.component(base_image=image_for("promote"), install_kfp_package=False)
def promote(
    student: Input[Model],
    onnx_fp32: Input[Model],
    int8_dynamic: Input[Model],
    int8_qdq: Input[Model],
    engine: Input[Artifact],
    evaluation: Input[Artifact],
    release_root: str,
    version: str = "",
    preset: str = "tiny-cpu",
    overrides: str = "{}",
) -> str:
    """Copy the release to ``<release_root>/models/<name>/<version>/`` with a lineage manifest; never overwrites.

    Args:
        student: Distilled student model.
        onnx_fp32: FP32 ONNX model.
        int8_dynamic: Dynamic INT8 ONNX model.
        int8_qdq: Q/DQ INT8 ONNX model.
        engine: TensorRT engine directory or its skipped status.
        evaluation: Evaluation results and report.
        release_root: Registry root, local path or ``s3://bucket/prefix``.
        version: Release version; empty picks a UTC timestamp ``vYYYYMMDD-HHMMSS``.
        preset: lmforge preset the stage config starts from.
        overrides: JSON object of PromoteConfig fields, e.g. {"model_name": "support-bot"}.

    Returns:
        The release URI.
    """
    from pathlib import Path

    from lmforge import release
    from lmforge.component_io import setup_logging
    from lmforge.config import resolve_stage_config

    setup_logging()
    cfg = resolve_stage_config("promote", preset, overrides)
    result = release.promote(
        cfg,
        release_root=release_root,
        version=version or release.default_version(),
        artifacts={
            "student": Path(student.path),
            "onnx_fp32": Path(onnx_fp32.path),
            "int8_dynamic": Path(int8_dynamic.path),
            "int8_qdq": Path(int8_qdq.path),
            "tensorrt": Path(engine.path),
        },
        evaluation_dir=Path(evaluation.path),
    )
    return str(result.summary["release_uri"])
