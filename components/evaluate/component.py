"""KFP component of the `evaluate` stage; its contract (ports, descriptions) is its entry in lmforge.stages."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Markdown, Metrics, Model, Output

from lmforge_kfp.components.images import image_for
from lmforge_kfp.components.signature import documented


@dsl.component(base_image=image_for("evaluate"), install_kfp_package=False)
@documented("evaluate")
def evaluate(
    shards: Input[Dataset],
    evaluation: Output[Artifact],
    metrics: Output[Metrics],
    report: Output[HTML],
    summary: Output[Markdown],
    teacher: Input[Model] = None,
    student: Input[Model] = None,
    onnx_fp32: Input[Model] = None,
    int8_dynamic: Input[Model] = None,
    int8_qdq: Input[Model] = None,
    engine: Input[Artifact] = None,
    cleaned: Input[Dataset] = None,
    base: Input[Model] = None,
    qa_uri: str = "",
    release_root: str = "",
    model_name: str = "",
    production_fingerprint: str = "",
    preset: str = "tiny-cpu",
    overrides: str = "{}",
) -> bool:
    from lmforge_kfp.runtime import run_component

    return run_component("evaluate", locals())
