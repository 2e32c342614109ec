"""KFP component of the `tokenize` stage; its contract (ports, descriptions) is its entry in lmforge.stages."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Output

from lmforge_kfp.components.images import image_for
from lmforge_kfp.components.signature import documented


@dsl.component(base_image=image_for("tokenize"), install_kfp_package=False)
@documented("tokenize")
def tokenize(
    cleaned: Input[Dataset],
    tokenizer: Output[Artifact],
    shards: Output[Dataset],
    metrics: Output[Metrics],
    base_model: str = "",
    base_model_fingerprint: str = "",
    preset: str = "tiny-cpu",
    overrides: str = "{}",
):
    from lmforge_kfp.runtime import run_component

    run_component("tokenize", locals())
