"""KFP component: clean one shard of the corpus and sign its documents for global dedup."""

from kfp import dsl
from kfp.dsl import Dataset, Metrics, Output

from components.images import image_for


@dsl.component(base_image=image_for("clean_shard"), install_kfp_package=False)
def clean_shard(
    corpus_uri: str,
    shard_index: int,
    shard_count: int,
    shard: Output[Dataset],
    metrics: Output[Metrics],
    corpus_fingerprint: str = "",
    preset: str = "tiny-cpu",
    overrides: str = "{}",
):
    """Apply the cleaning rules and PII redaction to shard ``shard_index`` of ``shard_count``; MinHash-sign it.

    Args:
        corpus_uri: Raw corpus: local path, glob, ``s3://`` URI or ``demo://shakespeare``.
        shard_index: Which shard this task cleans (0-based).
        shard_count: How many shards the corpus is split into.
        shard: Surviving documents with their corpus keys, dedup signatures, quarantine sample and counters.
        metrics: Documents in/out and removals per rule for this shard.
        corpus_fingerprint: Content hash of the corpus from ``preflight``; part of the cache key.
        preset: lmforge preset the stage config starts from.
        overrides: JSON object of CleanConfig fields overriding the preset, e.g. {"min_words": 5}.
    """
    from lmforge.component_io import publish, setup_logging
    from lmforge.config import resolve_stage_config
    from lmforge.data import clean as stage

    setup_logging()
    shard.metadata["corpus_fingerprint"] = corpus_fingerprint
    cfg = resolve_stage_config("clean", preset, overrides)
    result = stage.clean_shard(
        cfg, corpus_uri=corpus_uri, shard=shard.path, shard_index=shard_index, shard_count=shard_count
    )
    publish(result, metrics=metrics)
