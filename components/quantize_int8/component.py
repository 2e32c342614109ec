"""KFP component: INT8 quantization (dynamic for CPU serving, calibrated Q/DQ for TensorRT)."""

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Metrics, Model, Output

from components.images import image_for


@dsl.component(base_image=image_for("quantize_int8"), install_kfp_package=False)
def quantize_int8(
    onnx_model: Input[Model],
    shards: Input[Dataset],
    int8_dynamic: Output[Model],
    int8_qdq: Output[Model],
    metrics: Output[Metrics],
    report: Output[HTML],
    preset: str = "tiny-cpu",
    overrides: str = "{}",
):
    """Quantize an FP32 ONNX model to INT8: dynamic (ONNX Runtime on CPU) and static Q/DQ calibrated on shards.

    Args:
        onnx_model: FP32 ONNX model directory from ``export_onnx``.
        shards: Token shards the calibration batches are drawn from (same tokenizer).
        int8_dynamic: Dynamically quantized ONNX model directory.
        int8_qdq: Statically calibrated Q/DQ ONNX model directory (TensorRT input).
        metrics: Sizes, perplexity delta vs FP32 and accepted (1/0) per INT8 model, time.
        report: HTML section with the accuracy gate's decision per INT8 model.
        preset: lmforge preset the stage config starts from.
        overrides: JSON object of QuantizeConfig fields, e.g. {"calibrate_method": "entropy"}.
    """
    from lmforge.component_io import publish, setup_logging
    from lmforge.config import resolve_stage_config
    from lmforge.export import quantize as stage

    setup_logging()
    cfg = resolve_stage_config("quantize_int8", preset, overrides)
    result = stage.run(
        cfg, onnx_model=onnx_model.path, shards=shards.path, int8_dynamic=int8_dynamic.path, int8_qdq=int8_qdq.path
    )
    publish(result, metrics=metrics, html=report)
