"""KFP component: the shard indices the cleaning fan-out iterates over."""

from kfp import dsl

from components.images import image_for


@dsl.component(base_image=image_for("plan_shards"), install_kfp_package=False)
def plan_shards(shard_count: int) -> list[int]:
    """List ``0 .. shard_count-1`` for ``dsl.ParallelFor`` over corpus shards.

    Args:
        shard_count: How many shards to split the corpus into (at least 1).

    Returns:
        The shard indices.
    """
    if shard_count < 1:
        raise ValueError(f"shard_count must be at least 1, got {shard_count}")
    return list(range(shard_count))
