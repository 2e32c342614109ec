"""KFP component of the `serve` stage; its contract (ports, descriptions) is its entry in lmforge.stages."""

from kfp import dsl
from kfp.dsl import Artifact, Metrics, Output

from lmforge_kfp.components.images import image_for
from lmforge_kfp.components.signature import documented


@dsl.component(base_image=image_for("serve"), install_kfp_package=False)
@documented("serve")
def serve(
    release: str,
    serving: Output[Artifact],
    metrics: Output[Metrics],
    predictor_image: str = "",
    gpu_node_selector: dict = {},  # noqa: B006 - KFP reads the default from the signature; it is never mutated
    gpu_tolerations: list = [],  # noqa: B006
    preset: str = "tiny-cpu",
    overrides: str = "{}",
):
    from lmforge_kfp.runtime import run_component

    run_component("serve", locals())
