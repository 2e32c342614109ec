"""KFP component of the `dedup_shards` stage; its contract (ports, descriptions) is its entry in lmforge.stages."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Output

from lmforge_kfp.components.images import image_for
from lmforge_kfp.components.signature import documented


@dsl.component(base_image=image_for("dedup_shards"), install_kfp_package=False)
@documented("dedup_shards")
def dedup_shards(
    shards: Input[list[Dataset]],
    plan: Output[Artifact],
    metrics: Output[Metrics],
    preset: str = "tiny-cpu",
    overrides: str = "{}",
):
    from lmforge_kfp.runtime import run_component

    run_component("dedup_shards", locals())
