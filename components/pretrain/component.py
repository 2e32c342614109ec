"""KFP component of the `pretrain` stage; its contract (ports, descriptions) is its entry in lmforge.stages."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Metrics, Model, Output

from lmforge_kfp.components.images import image_for
from lmforge_kfp.components.signature import documented


@dsl.component(base_image=image_for("pretrain"), install_kfp_package=False)
@documented("pretrain")
def pretrain(
    shards: Input[Dataset],
    tokenizer: Input[Artifact],
    model: Output[Model],
    metrics: Output[Metrics],
    curves: Output[HTML],
    base_model: str = "",
    base_model_fingerprint: str = "",
    preset: str = "tiny-cpu",
    overrides: str = "{}",
    launch: str = "{}",
    staging_uri: str = "",
    gpu_count: int = 1,
    job_image: str = "",
    run_root: str = "",
):
    from lmforge_kfp.runtime import run_component

    run_component("pretrain", locals())
