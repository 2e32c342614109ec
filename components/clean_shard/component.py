"""KFP component of the `clean_shard` stage; its contract (ports, descriptions) is its entry in lmforge.stages."""

from kfp import dsl
from kfp.dsl import Dataset, Metrics, Output

from lmforge_kfp.components.images import image_for
from lmforge_kfp.components.signature import documented


@dsl.component(base_image=image_for("clean_shard"), install_kfp_package=False)
@documented("clean_shard")
def clean_shard(
    corpus_uri: str,
    shard_index: int,
    shard_count: int,
    shard: Output[Dataset],
    metrics: Output[Metrics],
    corpus_fingerprint: str = "",
    preset: str = "tiny-cpu",
    overrides: str = "{}",
):
    from lmforge_kfp.runtime import run_component

    run_component("clean_shard", locals())
