"""KFP component of the `build_tensorrt` stage; its contract (ports, descriptions) is its entry in lmforge.stages."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Metrics, Model, Output

from lmforge_kfp.components.images import image_for
from lmforge_kfp.components.signature import documented


@dsl.component(base_image=image_for("build_tensorrt"), install_kfp_package=False)
@documented("build_tensorrt")
def build_tensorrt(
    int8_qdq: Input[Model],
    engine: Output[Artifact],
    metrics: Output[Metrics],
    preset: str = "tiny-cpu",
    overrides: str = "{}",
):
    from lmforge_kfp.runtime import run_component

    run_component("build_tensorrt", locals())
