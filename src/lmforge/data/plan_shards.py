"""The ``plan_shards`` stage: the shard indices of the cleaning fan-out."""

from __future__ import annotations

from lmforge.errors import ConfigError
from lmforge.results import StageResult


def run(*, shard_count: int) -> StageResult:
    """The ``plan_shards`` stage: shard indices ``0 .. shard_count-1`` for the cleaning fan-out.

    Raises:
        ConfigError: ``shard_count`` is below 1.
    """
    if shard_count < 1:
        raise ConfigError(f"shard_count: must be at least 1, got {shard_count}")
    return StageResult(metrics={"shards": float(shard_count)}, summary={"shard_indices": list(range(shard_count))})
