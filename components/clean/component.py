"""KFP component: clean a raw text corpus."""

from kfp import dsl
from kfp.dsl import HTML, Dataset, Metrics, Output

from components.images import image_for


@dsl.component(base_image=image_for("clean"), install_kfp_package=False)
def clean(
    corpus_uri: str,
    cleaned: Output[Dataset],
    metrics: Output[Metrics],
    report: Output[HTML],
    corpus_fingerprint: str = "",
    preset: str = "tiny-cpu",
    overrides: str = "{}",
):
    """Normalize, filter and exactly deduplicate a raw corpus into Parquet shards.

    Args:
        corpus_uri: Raw corpus: local path, glob, ``s3://`` URI or ``demo://shakespeare``; JSONL(.gz) or text.
        cleaned: Parquet shards (id, text, source, lang), quarantine sample, stats and manifest.
        metrics: Documents/bytes in and out, removals per rule, duplicate rate.
        report: HTML report with removals per rule.
        corpus_fingerprint: Content hash of the corpus from ``preflight``; part of the cache key, so changed
            data behind the same URI is never served from cache. Recorded on the output artifact.
        preset: lmforge preset the stage config starts from.
        overrides: JSON object of CleanConfig fields overriding the preset, e.g. {"min_words": 5}.
    """
    from lmforge.component_io import publish, setup_logging
    from lmforge.config import resolve_stage_config
    from lmforge.data import clean as stage

    setup_logging()
    cleaned.metadata["corpus_fingerprint"] = corpus_fingerprint
    result = stage.run(resolve_stage_config("clean", preset, overrides), corpus_uri=corpus_uri, cleaned=cleaned.path)
    publish(result, metrics=metrics, html=report)
