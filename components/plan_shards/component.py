"""KFP component of the `plan_shards` stage; its contract (ports, descriptions) is its entry in lmforge.stages."""

from kfp import dsl
from kfp.dsl import Metrics, Output

from lmforge_kfp.components.images import image_for
from lmforge_kfp.components.signature import documented


@dsl.component(base_image=image_for("plan_shards"), install_kfp_package=False)
@documented("plan_shards")
def plan_shards(
    shard_count: int,
    metrics: Output[Metrics],
) -> list[int]:
    from lmforge_kfp.runtime import run_component

    return run_component("plan_shards", locals())
