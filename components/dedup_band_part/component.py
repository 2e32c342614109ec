"""KFP component of the `dedup_band_part` stage; its contract (ports, descriptions) is its entry in lmforge.stages."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Output

from lmforge_kfp.components.images import image_for
from lmforge_kfp.components.signature import documented


@dsl.component(base_image=image_for("dedup_band_part"), install_kfp_package=False)
@documented("dedup_band_part")
def dedup_band_part(
    shards: Input[list[Dataset]],
    exact: Input[list[Artifact]],
    band_task: int,
    band_groups: int,
    parts: int,
    pairs: Output[Artifact],
    metrics: Output[Metrics],
    preset: str = "tiny-cpu",
    overrides: str = "{}",
):
    from lmforge_kfp.runtime import run_component

    run_component("dedup_band_part", locals())
