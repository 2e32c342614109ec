"""The ``clean`` stage: normalize, filter, redact PII and deduplicate raw documents.

The stage is three steps that also run separately under a pipeline fan-out:

1. ``clean_shard`` (once per input shard): normalize each document
   (:class:`~lmforge.data.cleaning.Normalize`), run the rules of :func:`~lmforge.data.cleaning.build_rules`
   (the first that rejects a document counts the removal and gives the reason), redact PII in the survivors
   and write them with their dedup signatures.
2. ``dedup_shards`` (once): exact and MinHash LSH dedup over all shards' signatures.
3. ``merge_shards`` (once): merge the shards in corpus order without the duplicates into Parquet
   shards ``part-NNNNN.parquet`` (columns ``id``, ``text``, ``source``, ``lang``), a sample of rejected
   documents per rule in ``quarantine.jsonl``, every malformed record (``file:line`` and problem) in
   ``bad_records.jsonl``, ``stats.json`` and an HTML report.

:func:`run` chains the three for a single process, calling them through the stage registry (a stage never
imports another stage's module); the output is the same for any number of shards.
"""

from __future__ import annotations

import time
from pathlib import Path

from lmforge.config import CleanConfig
from lmforge.results import StageResult
from lmforge.scratch import scratch_dir
from lmforge.stages import get_stage, run_stage


def run(cfg: CleanConfig, *, corpus_uri: str, cleaned: str | Path) -> StageResult:
    """Clean the corpus at ``corpus_uri`` into ``cleaned`` (committed only on success) in one process.

    The same three steps as the pipeline fan-out with one shard: ``clean_shard``, ``dedup_shards``,
    ``merge_shards``.

    Raises:
        InputDataError: the corpus is missing, has too many malformed records, has no documents, or
            no document survives cleaning.
    """
    start = time.perf_counter()
    with scratch_dir(".lmforge-clean-", Path(cleaned).parent) as scratch:
        shard = Path(scratch, "shard-00000")
        get_stage("clean_shard").function()(cfg, corpus_uri=corpus_uri, shard_index=0, shard_count=1, shard=shard)
        run_stage("dedup_shards", cfg, {"shards": [shard], "plan": Path(scratch, "dedup")})
        return get_stage("merge_shards").function()(
            cfg,
            corpus_uri=corpus_uri,
            shards=[shard],
            plan=Path(scratch, "dedup"),
            cleaned=cleaned,
            seconds=time.perf_counter() - start,
        )
