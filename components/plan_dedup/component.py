"""KFP component of the `plan_dedup` stage; its contract (ports, descriptions) is its entry in lmforge.stages."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Metrics, Output

from lmforge_kfp.components.images import image_for
from lmforge_kfp.components.signature import documented


@dsl.component(base_image=image_for("plan_dedup"), install_kfp_package=False)
@documented("plan_dedup")
def plan_dedup(
    band_groups: int,
    parts: int,
    metrics: Output[Metrics],
    preset: str = "tiny-cpu",
    overrides: str = "{}",
) -> NamedTuple("Outputs", [("exact_parts", list[int]), ("band_tasks", list[int])]):
    from lmforge_kfp.runtime import run_component

    return run_component("plan_dedup", locals())
