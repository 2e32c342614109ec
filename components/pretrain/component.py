"""KFP component: pretrain a causal LM from token shards."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Metrics, Model, Output

from components.images import image_for


@dsl.component(base_image=image_for("pretrain"), install_kfp_package=False)
def pretrain(
    shards: Input[Dataset],
    tokenizer: Input[Artifact],
    model: Output[Model],
    metrics: Output[Metrics],
    curves: Output[HTML],
    preset: str = "tiny-cpu",
    overrides: str = "{}",
    launch: str = "{}",
    staging_uri: str = "",
    gpu_count: int = 1,
    job_image: str = "",
):
    """Pretrain a GPT-2-shaped model (AdamW, warmup + cosine, clipping, autocast) on the token shards.

    Args:
        shards: Token shards from ``tokenize``.
        tokenizer: Tokenizer from ``tokenize`` (its hash must match the shards').
        model: Hugging Face model directory (safetensors, tokenizer, training_history.json).
        metrics: Train/validation loss, perplexity, tokens/s.
        curves: HTML loss curves.
        preset: lmforge preset the stage config starts from.
        overrides: JSON object of PretrainConfig fields, e.g. {"train.max_steps": 500, "model.n_layer": 6}.
        launch: JSON object of LaunchConfig fields (lmforge.config): how wide this step trains. Default {}: one pod,
            gpu_count processes (torchrun --standalone when gpu_count > 1, else in this process).
            {"num_nodes": 4, "gpus_per_node": 8} submits a Kubeflow Trainer TrainJob (or {"backend": "pytorchjob"})
            and waits for it; the job is named after the run id in $LMFORGE_RUN_ID (set by the lmforge pipeline from
            the pod label pipeline/runid), so a retried step adopts it.
        staging_uri: s3://bucket/prefix where a multi-node job's inputs and outputs are staged
            (<staging_uri>/<run id>/<task>/<name>); needed only with num_nodes > 1.
        gpu_count: GPUs of this step's pod (the pipeline passes its gpu_count); the default of launch.gpus_per_node.
        job_image: Image of the job's pods (num_nodes > 1); empty: this package's lmforge-train image.
    """
    from components.images import image_for
    from lmforge.component_io import publish, setup_logging
    from lmforge.launch import parse_launch, run_training_stage

    setup_logging()
    result = run_training_stage(
        "pretrain",
        parse_launch(launch, gpus_per_node=gpu_count),
        {"shards": shards.path, "tokenizer": tokenizer.path, "model": model.path},
        preset=preset,
        overrides=overrides,
        image=job_image or image_for("pretrain"),
        staging_uri=staging_uri,
    )
    publish(result, metrics=metrics, html=curves)
