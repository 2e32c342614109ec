"""KFP component of the `distill` stage; its contract (ports, descriptions) is its entry in lmforge.stages."""

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Metrics, Model, Output

from lmforge_kfp.components.images import image_for
from lmforge_kfp.components.signature import documented


@dsl.component(base_image=image_for("distill"), install_kfp_package=False)
@documented("distill")
def distill(
    teacher: Input[Model],
    shards: Input[Dataset],
    student: Output[Model],
    metrics: Output[Metrics],
    curves: Output[HTML],
    qa_uri: str = "",
    student_base: str = "",
    qa_fingerprint: str = "",
    student_base_fingerprint: str = "",
    preset: str = "tiny-cpu",
    overrides: str = "{}",
    launch: str = "{}",
    staging_uri: str = "",
    gpu_count: int = 1,
    job_image: str = "",
    run_root: str = "",
):
    from lmforge_kfp.runtime import run_component

    run_component("distill", locals())
