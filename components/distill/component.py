"""KFP component: knowledge distillation into a smaller student."""

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Metrics, Model, Output

from components.images import image_for


@dsl.component(base_image=image_for("distill"), install_kfp_package=False)
def distill(
    teacher: Input[Model],
    shards: Input[Dataset],
    student: Output[Model],
    metrics: Output[Metrics],
    curves: Output[HTML],
    preset: str = "tiny-cpu",
    overrides: str = "{}",
    launch: str = "{}",
    staging_uri: str = "",
    gpu_count: int = 1,
    job_image: str = "",
):
    """Train a shallower student on alpha·T²·KL(teacher‖student) + (1−alpha)·CE over the token shards.

    Args:
        teacher: Teacher causal LM (the merged LoRA model); must share the shards' tokenizer.
        shards: Token shards from ``tokenize``.
        student: Student Hugging Face model directory.
        metrics: Student and teacher validation loss, KL, tokens/s.
        curves: HTML loss curves.
        preset: lmforge preset the stage config starts from.
        overrides: JSON object of DistillConfig fields, e.g. {"temperature": 4.0, "alpha": 0.7}.
        launch: JSON object of LaunchConfig fields (lmforge.config): how wide this step trains. Default {}: one pod,
            gpu_count processes (torchrun --standalone when gpu_count > 1, else in this process).
            {"num_nodes": 4, "gpus_per_node": 8} submits a Kubeflow Trainer job as for pretrain (named after
            $LMFORGE_RUN_ID); a student_uri in overrides must then be s3://. The student trains data-parallel
            (DDP or DeepSpeed ZeRO); every rank runs its own frozen copy of the teacher.
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
        "distill",
        parse_launch(launch, gpus_per_node=gpu_count),
        {"teacher": teacher.path, "shards": shards.path, "student": student.path},
        preset=preset,
        overrides=overrides,
        image=job_image or image_for("distill"),
        staging_uri=staging_uri,
    )
    publish(result, metrics=metrics, html=curves)
