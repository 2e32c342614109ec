"""KFP component: the global exact + MinHash LSH dedup step over every shard's signatures."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Output

from components.images import image_for


@dsl.component(base_image=image_for("dedup_shards"), install_kfp_package=False)
def dedup_shards(
    shards: Input[list[Dataset]],
    plan: Output[Artifact],
    metrics: Output[Metrics],
    preset: str = "tiny-cpu",
    overrides: str = "{}",
):
    """Cluster exact and near duplicates across all shards; keep one document per cluster, deterministically.

    Args:
        shards: Cleaned shards from ``clean_shard`` (collected from the fan-out).
        plan: The corpus keys to remove, with the rule and the kept duplicate.
        metrics: Exact and near duplicates removed, cluster counts.
        preset: lmforge preset the stage config starts from.
        overrides: JSON object of CleanConfig fields, e.g. {"near_dedup.bands": 20}.
    """
    from lmforge.component_io import publish, setup_logging
    from lmforge.config import resolve_stage_config
    from lmforge.data import dedup as stage

    setup_logging()
    cfg = resolve_stage_config("clean", preset, overrides)
    publish(stage.run(cfg, shards=[s.path for s in shards], plan=plan.path), metrics=metrics)
