"""KFP component of the `dedup_union` stage; its contract (ports, descriptions) is its entry in lmforge.stages."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Output

from lmforge_kfp.components.images import image_for
from lmforge_kfp.components.signature import documented


@dsl.component(base_image=image_for("dedup_union"), install_kfp_package=False)
@documented("dedup_union")
def dedup_union(
    shards: Input[list[Dataset]],
    exact: Input[list[Artifact]],
    pairs: Input[list[Artifact]],
    plan: Output[Artifact],
    metrics: Output[Metrics],
    preset: str = "tiny-cpu",
    overrides: str = "{}",
):
    from lmforge_kfp.runtime import run_component

    run_component("dedup_union", locals())
