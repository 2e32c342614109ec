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
    """
    from lmforge.component_io import publish, setup_logging
    from lmforge.config import resolve_stage_config
    from lmforge.train import pretrain as stage

    setup_logging()
    cfg = resolve_stage_config("pretrain", preset, overrides)
    publish(stage.run(cfg, shards.path, tokenizer.path, model.path), metrics=metrics, html=curves)
