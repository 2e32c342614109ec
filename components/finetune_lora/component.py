"""KFP component: LoRA fine-tuning on prompt/response pairs."""

from kfp import dsl
from kfp.dsl import HTML, Input, Metrics, Model, Output

from components.images import image_for


@dsl.component(base_image=image_for("finetune_lora"), install_kfp_package=False)
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
):
    """Fine-tune the base model with LoRA (prompt tokens masked from the loss); emit adapter and merged model.

    Args:
        base_model: Hugging Face causal LM directory (e.g. from ``pretrain``).
        qa_uri: JSONL with ``prompt``/``response`` per line (local, ``s3://`` or ``demo://chatterbot``).
        adapter: PEFT adapter directory.
        merged_model: Standalone model with the adapter merged in.
        metrics: Held-out answer loss before/after, trainable fraction, tokens/s.
        curves: HTML loss curves.
        qa_fingerprint: Content hash of the Q&A data from ``preflight``; part of the cache key, so changed data
            behind the same URI is never served from cache. Recorded on the adapter artifact.
        preset: lmforge preset the stage config starts from.
        overrides: JSON object of LoraConfig fields, e.g. {"r": 16, "train.max_steps": 100}.
        launch: JSON object of LaunchConfig fields (lmforge.config): how wide this step trains. Default {}: one pod,
            gpu_count processes (torchrun --standalone when gpu_count > 1, else in this process).
            {"num_nodes": 4, "gpus_per_node": 8} submits a Kubeflow Trainer job as for pretrain (named after
            $LMFORGE_RUN_ID); its pods read qa_uri themselves, so it must be s3:// or demo:// there. DDP, or
            DeepSpeed ZeRO-1/2 with overrides {"train.distributed.backend": "deepspeed"}; ZeRO-3 is refused.
        staging_uri: s3://bucket/prefix where a multi-node job's inputs and outputs are staged
            (<staging_uri>/<run id>/<task>/<name>); needed only with num_nodes > 1.
        gpu_count: GPUs of this step's pod (the pipeline passes its gpu_count); the default of launch.gpus_per_node.
        job_image: Image of the job's pods (num_nodes > 1); empty: this package's lmforge-train image.
    """
    from components.images import image_for
    from lmforge.component_io import publish, setup_logging
    from lmforge.launch import parse_launch, run_training_stage

    setup_logging()
    adapter.metadata["qa_fingerprint"] = qa_fingerprint
    result = run_training_stage(
        "finetune_lora",
        parse_launch(launch, gpus_per_node=gpu_count),
        {"base_model": base_model.path, "qa_uri": qa_uri, "adapter": adapter.path, "merged_model": merged_model.path},
        preset=preset,
        overrides=overrides,
        image=job_image or image_for("finetune_lora"),
        staging_uri=staging_uri,
    )
    publish(result, metrics=metrics, html=curves)
