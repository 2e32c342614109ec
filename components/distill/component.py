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
    """
    from lmforge.component_io import publish, setup_logging
    from lmforge.config import resolve_stage_config
    from lmforge.train import distill as stage

    setup_logging()
    cfg = resolve_stage_config("distill", preset, overrides)
    publish(stage.run(cfg, teacher.path, shards.path, student.path), metrics=metrics, html=curves)
