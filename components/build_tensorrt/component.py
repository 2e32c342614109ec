"""KFP component: build a TensorRT engine from the Q/DQ ONNX model (GPU pool)."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Metrics, Model, Output

from components.images import image_for


@dsl.component(base_image=image_for("build_tensorrt"), install_kfp_package=False)
def build_tensorrt(
    int8_qdq: Input[Model],
    engine: Output[Artifact],
    metrics: Output[Metrics],
    preset: str = "tiny-cpu",
    overrides: str = "{}",
):
    """Build a strongly typed TensorRT engine; without TensorRT or a GPU, record an explicit ``skipped`` status.

    Args:
        int8_qdq: Q/DQ ONNX model directory from ``quantize_int8``.
        engine: ``engine.plan`` + ``build_record.json``, or ``status.json`` saying skipped and why.
        metrics: ``built`` (1/0) and build figures.
        preset: lmforge preset the stage config starts from.
        overrides: JSON object of TensorRTConfig fields, e.g. {"max_seq": 2048}.
    """
    from lmforge.component_io import publish, setup_logging
    from lmforge.config import resolve_stage_config
    from lmforge.export import tensorrt as stage

    setup_logging()
    cfg = resolve_stage_config("build_tensorrt", preset, overrides)
    publish(stage.run(cfg, int8_qdq=int8_qdq.path, engine=engine.path), metrics=metrics)
