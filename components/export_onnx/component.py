"""KFP component: export a causal LM to ONNX."""

from kfp import dsl
from kfp.dsl import Input, Metrics, Model, Output

from components.images import image_for


@dsl.component(base_image=image_for("export_onnx"), install_kfp_package=False)
def export_onnx(
    model: Input[Model],
    onnx_model: Output[Model],
    metrics: Output[Metrics],
    preset: str = "tiny-cpu",
    overrides: str = "{}",
):
    """Export to ONNX (torch.onnx dynamo exporter) and check logits parity against PyTorch.

    Args:
        model: Hugging Face causal LM directory.
        onnx_model: Directory with ``model.onnx``, tokenizer and config.
        metrics: Parity error, size, export time.
        preset: lmforge preset the stage config starts from.
        overrides: JSON object of ExportConfig fields, e.g. {"opset": 18}.
    """
    from lmforge.component_io import publish, setup_logging
    from lmforge.config import resolve_stage_config
    from lmforge.export import onnx_export as stage

    setup_logging()
    cfg = resolve_stage_config("export_onnx", preset, overrides)
    publish(stage.run(cfg, model=model.path, onnx_model=onnx_model.path), metrics=metrics)
