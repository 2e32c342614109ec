"""KFP component of the `merge_shards` stage; its contract (ports, descriptions) is its entry in lmforge.stages."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Metrics, Output

from lmforge_kfp.components.images import image_for
from lmforge_kfp.components.signature import documented


@dsl.component(base_image=image_for("merge_shards"), install_kfp_package=False)
@documented("merge_shards")
def merge_shards(
    corpus_uri: str,
    shards: Input[list[Dataset]],
    plan: Input[Artifact],
    cleaned: Output[Dataset],
    metrics: Output[Metrics],
    report: Output[HTML],
    preset: str = "tiny-cpu",
    overrides: str = "{}",
):
    from lmforge_kfp.runtime import run_component

    run_component("merge_shards", locals())
