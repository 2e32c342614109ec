"""KFP component of the `quantize_int8` stage; its contract (ports, descriptions) is its entry in lmforge.stages."""

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Metrics, Model, Output

from lmforge_kfp.components.images import image_for
from lmforge_kfp.components.signature import documented


@dsl.component(base_image=image_for("quantize_int8"), install_kfp_package=False)
@documented("quantize_int8")
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
    from lmforge_kfp.runtime import run_component

    run_component("quantize_int8", locals())
