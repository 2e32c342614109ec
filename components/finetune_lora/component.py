"""KFP component of the `finetune_lora` stage; its contract (ports, descriptions) is its entry in lmforge.stages."""

from kfp import dsl
from kfp.dsl import HTML, Input, Metrics, Model, Output

from lmforge_kfp.components.images import image_for
from lmforge_kfp.components.signature import documented


@dsl.component(base_image=image_for("finetune_lora"), install_kfp_package=False)
@documented("finetune_lora")
def finetune_lora(
    base_model: Input[Model],
    qa_uri: str,
    adapter: Output[Model],
    merged_model: Output[Model],
    metrics: Output[Metrics],
    curves: Output[HTML],
    qa_fingerprint: str = "",
    preset: str = "tiny-cpu",
    overrides: str = "{}",
    launch: str = "{}",
    staging_uri: str = "",
    gpu_count: int = 1,
    job_image: str = "",
    run_root: str = "",
):
    from lmforge_kfp.runtime import run_component

    run_component("finetune_lora", locals())
