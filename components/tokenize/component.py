"""KFP component: train a tokenizer and pack token shards."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Output

from components.images import image_for


@dsl.component(base_image=image_for("tokenize"), install_kfp_package=False)
def tokenize(
    cleaned: Input[Dataset],
    tokenizer: Output[Artifact],
    shards: Output[Dataset],
    metrics: Output[Metrics],
    preset: str = "tiny-cpu",
    overrides: str = "{}",
):
    """Train a byte-level BPE tokenizer on the cleaned corpus and pack train/val token shards.

    Args:
        cleaned: Cleaned corpus from the ``clean`` component.
        tokenizer: Hugging Face fast tokenizer directory.
        shards: ``train-NNNNN.bin`` / ``val-NNNNN.bin`` token shards with ``index.json``.
        metrics: Vocabulary size, token counts, throughput.
        preset: lmforge preset the stage config starts from.
        overrides: JSON object of TokenizeConfig fields overriding the preset, e.g. {"vocab_size": 8192}.
    """
    from lmforge.component_io import publish, setup_logging
    from lmforge.config import resolve_stage_config
    from lmforge.data import tokenize as stage

    setup_logging()
    cfg = resolve_stage_config("tokenize", preset, overrides)
    publish(stage.run(cfg, cleaned=cleaned.path, tokenizer=tokenizer.path, shards=shards.path), metrics=metrics)
