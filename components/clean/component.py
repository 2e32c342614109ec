"""KFP component of the `clean` stage; its contract (ports, descriptions) is its entry in lmforge.stages."""

from kfp import dsl
from kfp.dsl import HTML, Dataset, Metrics, Output

from lmforge_kfp.components.images import image_for
from lmforge_kfp.components.signature import documented


@dsl.component(base_image=image_for("clean"), install_kfp_package=False)
@documented("clean")
def clean(
    corpus_uri: str,
    cleaned: Output[Dataset],
    metrics: Output[Metrics],
    report: Output[HTML],
    corpus_fingerprint: str = "",
    preset: str = "tiny-cpu",
    overrides: str = "{}",
):
    from lmforge_kfp.runtime import run_component

    run_component("clean", locals())
