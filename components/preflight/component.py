"""KFP component of the `preflight` stage; its contract (ports, descriptions) is its entry in lmforge.stages."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Metrics, Output

from lmforge_kfp.components.images import image_for
from lmforge_kfp.components.signature import documented


@dsl.component(base_image=image_for("preflight"), install_kfp_package=False)
@documented("preflight")
def preflight(
    corpus_uri: str,
    qa_uri: str,
    release_root: str,
    metrics: Output[Metrics],
    s3_secret_name: str = "lmforge-s3",
    launch: str = "{}",
    gpu_count: int = 1,
    model_name: str = "",
    preset: str = "tiny-cpu",
    base_model_uri: str = "",
    student_base_uri: str = "",
    staging_uri: str = "",
    clean_overrides: str = "{}",
    tokenize_overrides: str = "{}",
    pretrain_overrides: str = "{}",
    finetune_lora_overrides: str = "{}",
    distill_overrides: str = "{}",
    export_onnx_overrides: str = "{}",
    quantize_int8_overrides: str = "{}",
    build_tensorrt_overrides: str = "{}",
    evaluate_overrides: str = "{}",
    serve_overrides: str = "{}",
) -> NamedTuple(
    "Outputs",
    [
        ("corpus_fingerprint", str),
        ("qa_fingerprint", str),
        ("production_fingerprint", str),
        ("gpu_limit", str),
        ("model_name", str),
        ("base_model_fingerprint", str),
        ("student_base_fingerprint", str),
        ("run_root", str),
    ],
):
    from lmforge_kfp.runtime import run_component

    return run_component("preflight", locals())
