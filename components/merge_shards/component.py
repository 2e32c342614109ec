"""KFP component: merge cleaned shards into the cleaned corpus, dropping the duplicates."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Metrics, Output

from components.images import image_for


@dsl.component(base_image=image_for("merge_shards"), install_kfp_package=False)
def merge_shards(
    corpus_uri: str,
    shards: Input[list[Dataset]],
    plan: Input[Artifact],
    cleaned: Output[Dataset],
    metrics: Output[Metrics],
    report: Output[HTML],
    preset: str = "tiny-cpu",
    overrides: str = "{}",
):
    """Merge the shards in corpus order without the documents the dedup plan removes; the same output as ``clean``.

    Args:
        corpus_uri: The raw corpus URI (recorded in the manifest).
        shards: Cleaned shards from ``clean_shard``.
        plan: Removal plan from ``dedup_shards``.
        cleaned: Parquet shards (id, text, source, lang), quarantine sample, stats and manifest.
        metrics: Documents/bytes in and out, removals per rule, duplicate rate.
        report: HTML report with removals per rule.
        preset: lmforge preset the stage config starts from.
        overrides: JSON object of CleanConfig fields overriding the preset.
    """
    from lmforge.component_io import publish, setup_logging
    from lmforge.config import resolve_stage_config
    from lmforge.data import clean as stage

    setup_logging()
    cfg = resolve_stage_config("clean", preset, overrides)
    result = stage.finalize(
        cfg, corpus_uri=corpus_uri, shards=[s.path for s in shards], plan=plan.path, cleaned=cleaned.path
    )
    publish(result, metrics=metrics, html=report)
