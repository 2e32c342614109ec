"""KFP component of the `export_onnx` stage; its contract (ports, descriptions) is its entry in lmforge.stages."""

from kfp import dsl
from kfp.dsl import Input, Metrics, Model, Output

from lmforge_kfp.components.images import image_for
from lmforge_kfp.components.signature import documented


@dsl.component(base_image=image_for("export_onnx"), install_kfp_package=False)
@documented("export_onnx")
def export_onnx(
    model: Input[Model],
    onnx_model: Output[Model],
    metrics: Output[Metrics],
    preset: str = "tiny-cpu",
    overrides: str = "{}",
):
    from lmforge_kfp.runtime import run_component

    run_component("export_onnx", locals())
