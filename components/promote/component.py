"""KFP component of the `promote` stage; its contract (ports, descriptions) is its entry in lmforge.stages."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Metrics, Model, Output

from lmforge_kfp.components.images import image_for
from lmforge_kfp.components.signature import documented


@dsl.component(base_image=image_for("promote"), install_kfp_package=False)
@documented("promote")
def promote(
    student: Input[Model],
    onnx_fp32: Input[Model],
    int8_dynamic: Input[Model],
    int8_qdq: Input[Model],
    engine: Input[Artifact],
    evaluation: Input[Artifact],
    release_root: str,
    model_name: str,
    metrics: Output[Metrics],
    version: str = "",
) -> str:
    from lmforge_kfp.runtime import run_component

    return run_component("promote", locals())
