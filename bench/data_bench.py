"""Clean + dedup throughput, peak memory and near-duplicate recall, ours against datatrove (no network).

Three sections, each writing JSON to ``bench/results/``:

``throughput`` (default; ``data_bench.json``)
    A corpus of the packaged Shakespeare scenes repeated with a seeded fraction of words substituted per
    copy (so near dedup has real work) until it reaches ``--mb``. Runs ``clean.run`` with the preset's
    rules without language ID (the rule set datatrove can run offline), ours again with lingua, and with
    ``--peer datatrove`` datatrove's GopherRepetition, GopherQuality, C4Quality, FineWebQuality filters,
    PII formatter and its four MinHash stages with the same thresholds, n-gram size, bands and rows.
    Datatrove's LanguageFilter needs a fastText model download, so language ID is left out of the
    comparison; ours with lingua is reported on its own row. Datatrove splits English with spaCy (its
    default tokenizer assignment); its xxhash call is adapted to xxhash >= 4 (see
    :func:`_patch_xxhash_for_datatrove`).
``recall`` (``data_recall.json``)
    Planted near copies of distinct scenes at word edit rates from 1 % to 20 %: recall and precision
    of our MinHash LSH in several shingle/band settings and, with ``--peer datatrove``, of datatrove's.
``memory`` (``data_memory.json``)
    One run of ours on a large corpus (``--mb 1024``) with the process's RSS sampled over the run.
``dedup`` (``data_dedup_memory.json``)
    Peak RSS and time of the single-pod dedup and of each step of the partitioned one (exact parts, band
    parts, union) over ``--docs`` synthetic signatures in 1 and in 8 shards; both must give the same plan.
``workers`` (``data_workers.json``)
    ``clean_shard`` on the whole corpus with 1 worker process and with ``--workers`` (default: the CPUs
    available), in ``1, N, N, 1`` order, ``--repeat`` rounds: docs/s of each and the ratio per round; the
    peer is N 1-process runs at once on N stripes of the corpus (shared nothing: the machine's ceiling).

Every run is a fresh interpreter (imports and start-up are in its wall time, nothing else is in the
process), on one core: ours is one process (``workers: 1``; the ``workers`` section compares more),
datatrove runs every stage with ``workers=1``. Peak RSS is the child's ``ru_maxrss`` from ``wait4`` (the
largest single process of its tree) and the largest sampled sum of ``VmRSS`` over the child and its
descendants (datatrove starts a ``multiprocess`` manager process even with one worker).

    python -m bench.data_bench throughput --mb 50 --peer datatrove
    python -m bench.data_bench recall --peer datatrove
    python -m bench.data_bench memory --mb 1024 --no-langid
    python -m bench.data_bench workers --mb 10 --repeat 3
    python -m bench.data_bench dedup --docs 1000000 --groups 4 --parts 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from bench.common import load_average, machine_facts, package_versions, result_path, text_table, write_results
from tests.support.near_copies import edit_words

WORDS = ("anon", "prithee", "sirrah", "forsooth", "marry", "zounds", "alack", "methinks")
BOILERPLATE = "\n\nThis text is provided by the Demo Library. All rights reserved; reproduction permitted for study."


def scenes() -> list[str]:
    from lmforge.data.demo import shakespeare_documents

    return [d["text"] for d in shakespeare_documents()]


def build_corpus(path: Path, megabytes: float, edit_rate: float, seed: int) -> tuple[int, int]:
    """Write JSONL copies of the scenes with ``edit_rate`` of words substituted; return (docs, bytes).

    Streams to disk, so a corpus of any size takes one scene's worth of memory.
    """
    rng = random.Random(seed)
    texts = scenes()
    target, written, docs = int(megabytes * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as fh:
        copy = 0
        while written < target:
            for scene in texts:
                words = scene.split(" ")
                if copy:
                    for i in rng.sample(range(len(words)), k=max(1, int(len(words) * edit_rate))):
                        words[i] = rng.choice(WORDS)
                line = json.dumps({"id": f"c{copy}-{docs}", "text": " ".join(words)}) + "\n"
                fh.write(line)
                written += len(line.encode())
                docs += 1
                if written >= target:
                    break
            copy += 1
    return docs, written


# ---------------------------------------------------------------------------------------------------------
# Child processes: one measured run each


def _clean_config(preset: str, overrides: dict[str, Any]) -> Any:
    from lmforge.config import CleanConfig
    from lmforge.stages import resolve_stage_config

    base = resolve_stage_config("clean", preset).model_dump()
    for key, value in overrides.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return CleanConfig.model_validate(base)


def child_ours(spec: dict[str, Any]) -> dict[str, Any]:
    """``clean.run`` over the corpus; returns its metrics."""
    from lmforge.data import clean
    from lmforge.formats.cleaned import read_cleaned

    cfg = _clean_config(spec["preset"], spec["overrides"])
    start = time.perf_counter()
    result = clean.run(cfg, corpus_uri=spec["corpus"], cleaned=spec["out"])
    wall = time.perf_counter() - start
    kept = [r["id"] for r in read_cleaned(spec["out"], verify=False)] if spec.get("kept_ids") else None
    return {"wall_s": wall, "metrics": result.metrics, "kept_ids": kept}


def child_shard(spec: dict[str, Any]) -> dict[str, Any]:
    """``clean_shard.run`` over shard ``spec["shard"]`` (default: all) with ``spec["overrides"]``'s workers."""
    from lmforge.data import clean_shard

    cfg = _clean_config(spec["preset"], spec["overrides"])
    start = time.perf_counter()
    index, count = spec.get("shard", (0, 1))
    result = clean_shard.run(cfg, corpus_uri=spec["corpus"], shard_index=index, shard_count=count, shard=spec["out"])
    return {"wall_s": time.perf_counter() - start, "metrics": result.metrics}


def child_dedup_step(spec: dict[str, Any]) -> dict[str, Any]:
    """One dedup step (``single``, ``exact``, ``band`` or ``union``) over synthetic signature shards."""
    import resource

    from lmforge.config import CleanConfig
    from lmforge.data import dedup_band_part, dedup_exact_part, dedup_shards, dedup_union

    cfg = CleanConfig()
    shards = spec["shards"]
    idle_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # interpreter and imports
    start = time.perf_counter()
    step, out = spec["step"], spec["out"]
    if step == "single":
        result = dedup_shards.run(cfg, shards=shards, plan=out)
    elif step == "exact":
        result = dedup_exact_part.run(cfg, shards=shards, part=spec["part"], parts=spec["parts"], exact=out)
    elif step == "band":
        band = {key: spec[key] for key in ("band_task", "band_groups", "parts")}
        result = dedup_band_part.run(cfg, shards=shards, exact=spec["exact"], **band, pairs=out)
    else:
        result = dedup_union.run(cfg, shards=shards, exact=spec["exact"], pairs=spec["band_dirs"], plan=out)
    return {"wall_s": time.perf_counter() - start, "metrics": result.metrics, "imports_rss_mb": idle_kb / 1024}


def synthetic_signature_shards(root: Path, docs: int, shards: int, seed: int) -> list[str]:
    """``cleaned-shard`` artifacts holding only signatures: ``docs`` documents, 10 % exact and 10 % near copies.

    The dedup steps read nothing else, so their memory and time depend only on these arrays.
    """
    import numpy as np

    from lmforge.artifacts import write_manifest
    from lmforge.config import CleanConfig
    from lmforge.formats.dedup import save_signatures

    near = CleanConfig().near_dedup
    perms = near.bands * near.rows
    rng = np.random.default_rng(seed)
    sig = rng.integers(0, 2**32, (docs, perms), dtype=np.uint32)
    exact = rng.integers(0, 256, (docs, 16), dtype=np.uint8)
    copies = rng.choice(docs, docs // 5, replace=False)
    sources = rng.integers(0, docs, len(copies))
    half = len(copies) // 2
    exact[copies[:half]] = exact[sources[:half]]  # exact copies: same digest and signature
    sig[copies[:half]] = sig[sources[:half]]
    sig[copies[half:]] = sig[sources[half:]]  # near copies: ~20 % of the positions changed
    changed = rng.random((len(copies) - half, perms)) < 0.2
    sig[copies[half:]] = np.where(changed, rng.integers(0, 2**32, changed.shape, dtype=np.uint32), sig[copies[half:]])
    dirs = []
    for i, rows in enumerate(np.array_split(np.arange(docs), shards)):
        shard = root / f"shard-{i:05d}"
        shard.mkdir(parents=True)
        save_signatures(shard, rows.tolist(), [e.tobytes() for e in exact[rows]], list(sig[rows]), perms)
        write_manifest(shard, "cleaned-shard")
        dirs.append(str(shard))
    return dirs


def _dedup_step(where: tuple[list[dict[str, Any]], Path, list[str]], **spec: Any) -> dict[str, Any]:
    """Run one dedup step in a fresh process; append its row (peak RSS, time) to ``where[0]``."""
    rows, root, shards = where
    out = root / f"{spec['step']}-{len(rows)}"
    run = measure("dedup", {"shards": shards, "out": str(out), **spec}, sample_s=0.5)
    row = {"shards": len(shards), "step": spec["step"], "wall_s": run["wall_s"], "peak_rss_mb": run["peak_rss_mb"]}
    row |= {"imports_rss_mb": run["imports_rss_mb"], **{k: v for k, v in spec.items() if k in ("band_task", "part")}}
    rows.append(row)
    print(
        f"{len(shards)} shard(s) {spec['step']:<7} {row['peak_rss_mb']:7.0f} MB peak, {row['wall_s']:6.1f} s",
        flush=True,
    )
    return {"out": str(out), **run}


def dedup_memory(args: argparse.Namespace) -> dict[str, Any]:
    """Peak RSS and time of the single-pod dedup and of each partitioned step, for 1 and 8 shards."""
    from lmforge.config import CleanConfig
    from lmforge.data import plan_dedup

    scratch = Path(tempfile.mkdtemp(prefix="lmforge-dedup-bench-", dir=args.scratch))
    rows = []
    try:
        for shard_count in (1, 8):
            root = scratch / f"s{shard_count}"
            # in a child: a forked child's ru_maxrss starts from its parent's, so the parent stays small
            made = measure("synth", {"root": str(root), "docs": args.docs, "shards": shard_count, "seed": args.seed,
                                     "out": str(root) + ".synth"})  # fmt: skip
            shards = made["shards"]
            parts = args.parts
            planned = plan_dedup.run(CleanConfig(), band_groups=args.groups, parts=parts).summary

            where = (rows, root, shards)
            single = _dedup_step(where, step="single")
            exact = [_dedup_step(where, step="exact", part=p, parts=parts)["out"] for p in planned["exact_parts"]]
            band_dirs = [
                _dedup_step(where, step="band", exact=exact, band_task=t, band_groups=args.groups, parts=parts)["out"]
                for t in planned["band_tasks"]
            ]
            union = _dedup_step(where, step="union", exact=exact, band_dirs=band_dirs)
            assert union["metrics"] == single["metrics"], (union["metrics"], single["metrics"])
            shutil.rmtree(root, ignore_errors=True)
        return {"docs": args.docs, "groups": args.groups, "parts": args.parts, "rows": rows}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _patch_xxhash_for_datatrove() -> None:
    """datatrove 0.10 calls ``xxhash.xxh64_intdigest(str)``, which xxhash >= 4 refuses (it wants bytes).

    Its ``processing`` extra pins ``xxhash<4``; this environment has 4.x for ``datasets``, so the bench
    encodes the shingle string first (what xxhash 3 did internally). Cost: one ``str.encode`` a shingle.
    """
    import xxhash
    from datatrove.utils.hashes import xxhash as dt_xxhash

    dt_xxhash.xxhash64 = lambda text: xxhash.xxh64_intdigest(text.encode("utf-8"))
    dt_xxhash.xxhash32 = lambda text: xxhash.xxh32_intdigest(text.encode("utf-8"))


def _datatrove_thresholds(rules: BaseModel) -> dict[str, Any]:
    """A rule family's thresholds as keyword arguments of datatrove's filter for it: the config names its fields
    after datatrove's parameters; n-gram limits become ``(n, max_fraction)`` tuples."""
    kwargs = rules.model_dump(exclude={"enabled", "languages"})
    for name in ("top_n_grams", "dup_n_grams"):
        if name in kwargs:
            kwargs[name] = tuple((limit["n"], limit["max_fraction"]) for limit in kwargs[name])
    return kwargs


def child_datatrove(spec: dict[str, Any]) -> dict[str, Any]:
    """datatrove's FineWeb-style filters + PII + MinHash (4 stages) with our thresholds, ``workers=1``."""
    _patch_xxhash_for_datatrove()
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )
    from datatrove.pipeline.formatters import PIIFormatter
    from datatrove.pipeline.readers import JsonlReader, ParquetReader
    from datatrove.pipeline.writers import ParquetWriter

    cfg = _clean_config(spec["preset"], spec["overrides"])
    near = cfg.near_dedup
    minhash = MinhashConfig(n_grams=near.ngram, num_buckets=near.bands, hashes_per_bucket=near.rows, seed=near.seed)
    root = Path(spec["out"])
    corpus = Path(spec["corpus"])
    filters: list[Any] = []
    if spec["rules"]:
        filters = [
            GopherRepetitionFilter(**_datatrove_thresholds(cfg.gopher_repetition)),
            GopherQualityFilter(**_datatrove_thresholds(cfg.gopher_quality)),
            C4QualityFilter(split_paragraph=True, **_datatrove_thresholds(cfg.c4)),
            FineWebQualityFilter(**_datatrove_thresholds(cfg.fineweb)),
            PIIFormatter(),
        ]
    parquet = {"compression": "zstd"}
    stages: dict[str, float] = {}

    def execute(name: str, pipeline: list[Any], tasks: int = 1) -> None:
        start = time.perf_counter()
        LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=1, logging_dir=str(root / "logs" / name)).run()
        stages[name] = time.perf_counter() - start

    start = time.perf_counter()
    execute(
        "filter+signatures",
        [
            JsonlReader(str(corpus.parent), glob_pattern=corpus.name),
            *filters,
            ParquetWriter(str(root / "filtered"), **parquet),
            MinhashDedupSignature(output_folder=str(root / "signatures"), config=minhash),
        ],
    )
    execute(
        "buckets",
        [
            MinhashDedupBuckets(
                input_folder=str(root / "signatures"), output_folder=str(root / "buckets"), config=minhash
            )
        ],
        tasks=minhash.num_buckets,
    )
    execute(
        "cluster",
        [MinhashDedupCluster(input_folder=str(root / "buckets"), output_folder=str(root / "remove"), config=minhash)],
    )
    execute(
        "dedup filter",
        [
            ParquetReader(str(root / "filtered")),
            MinhashDedupFilter(input_folder=str(root / "remove")),
            ParquetWriter(str(root / "deduped"), **parquet),
        ],
    )
    wall = time.perf_counter() - start
    import pyarrow.parquet as pq

    def ids(folder: str) -> list[str]:
        return [i for f in sorted((root / folder).glob("*.parquet")) for i in pq.read_table(f, columns=["id"])["id"]]

    filtered, deduped = ids("filtered"), ids("deduped")
    out = {"wall_s": wall, "stages_s": stages, "docs_after_rules": len(filtered), "docs_out": len(deduped)}
    out["kept_ids"] = [str(i) for i in deduped] if spec.get("kept_ids") else None
    return out


def _tree_rss_kb(pid: int) -> int:
    """Sum of VmRSS over ``pid`` and its descendants (0 once the process is gone)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next((int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS:")), 0)
            for task in Path(f"/proc/{p}/task").iterdir():
                stack.extend(int(c) for c in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def measure(kind: str, spec: dict[str, Any], sample_s: float = 0.25) -> dict[str, Any]:
    """Run one child (``ours`` or ``datatrove``); return its result, wall time and peak RSS."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(spec, fh)
    result_file = fh.name + ".out"
    cmd = [sys.executable, "-m", __spec__.name, "_child", kind, fh.name, result_file]
    stderr = open(Path(spec["out"]).with_suffix(".log"), "w")  # noqa: SIM115 - closed below
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=stderr, stderr=stderr)
    samples: list[tuple[float, int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(sample_s):
            samples.append((time.perf_counter() - start, _tree_rss_kb(proc.pid)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    sampler.join()
    stderr.close()
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        log = Path(stderr.name).read_text()[-4000:]
        raise RuntimeError(f"{kind} run failed with exit code {proc.returncode}:\n{log}")
    result = json.loads(Path(result_file).read_text())
    os.unlink(fh.name)
    os.unlink(result_file)
    result["process_s"] = elapsed
    result["peak_rss_mb"] = usage.ru_maxrss / 1024
    result["peak_tree_rss_mb"] = max((kb for _, kb in samples), default=0) / 1024
    result["rss_samples_mb"] = [(round(t, 1), round(kb / 1024, 1)) for t, kb in samples]
    return result


# ---------------------------------------------------------------------------------------------------------
# Sections


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix="lmforge-data-bench-", dir=args.scratch))
    try:
        corpus = scratch / "corpus.jsonl"
        docs, size = build_corpus(corpus, args.mb, args.edit_rate, args.seed)
        runs: dict[str, dict[str, Any]] = {}
        plan = [("ours, no language ID", "ours", {"language": {"enabled": False}, "workers": 1})]
        if not args.no_langid:
            plan.append(("ours, lingua language ID", "ours", {"workers": 1}))
        if args.peer == "datatrove":
            plan.append(("datatrove (workers=1), no language ID", "datatrove", {}))
        for label, kind, overrides in plan:
            for rep in range(args.repeat):
                out = scratch / f"out-{len(runs)}-{rep}"
                spec = {"corpus": str(corpus), "out": str(out), "preset": args.preset, "overrides": overrides}
                spec["rules"] = True
                print(f"running {label} (repeat {rep + 1}/{args.repeat}) ...", file=sys.stderr, flush=True)
                run = measure(kind, spec)
                shutil.rmtree(out, ignore_errors=True)
                if label not in runs or run["process_s"] < runs[label]["process_s"]:
                    runs[label] = run
        rows = []
        for label, run in runs.items():
            m = run.get("metrics", {})
            row = {
                "run": label,
                "docs_in": docs,
                "docs_out": int(m.get("docs_out", run.get("docs_out", 0))),
                "wall_s": run["process_s"],
                "docs_per_s": docs / run["process_s"],
                "mb_per_s": size / 1e6 / run["process_s"],
                "peak_rss_mb": run["peak_rss_mb"],
                "peak_tree_rss_mb": run["peak_tree_rss_mb"],
            }
            if "stages_s" in run:
                row["stages_s"] = run["stages_s"]
                row["docs_after_rules"] = run["docs_after_rules"]
            else:
                removed = {k.removeprefix("removed_"): int(v) for k, v in m.items() if k.startswith("removed_") and v}
                row["removed"] = removed
            rows.append(row)
        base = next((r for r in rows if r["run"].startswith("datatrove")), None)
        for row in rows:
            row["speedup_vs_datatrove"] = base["wall_s"] / row["wall_s"] if base else None
        print(f"\ncorpus: {size / 1e6:.1f} MB JSONL, {docs} docs, {args.edit_rate:.0%} word edits per copy")
        print("wall includes interpreter start and imports; datatrove has no offline language ID, so the")
        print("like-for-like comparison is the two rows without language ID\n")
        print(
            text_table(
                ["run", "docs out", "wall s", "docs/s", "MB/s", "peak RSS MB", "tree RSS MB", "x datatrove"],
                [
                    [
                        r["run"],
                        r["docs_out"],
                        r["wall_s"],
                        r["docs_per_s"],
                        r["mb_per_s"],
                        r["peak_rss_mb"],
                        r["peak_tree_rss_mb"],
                        r["speedup_vs_datatrove"] if base else "-",
                    ]
                    for r in rows
                ],
            )
        )
        return {"corpus_mb": size / 1e6, "docs_in": docs, "runs": rows}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def planted_corpus(path: Path, rate: float | tuple[float, float], seed: int, copies: int) -> dict[str, list[str]]:
    """Distinct scenes of >= 300 words and ``copies`` near copies at word edit ``rate``, shuffled.

    Edits delete, substitute or insert a word with equal chance (``edit_words``, as the dedup tests); 30 % of
    copies are upper-cased, 70 % get a boilerplate footer. Returns the ids by role: ``base``, ``near``.
    """
    rng = random.Random(seed)
    base = [t for t in scenes() if len(t.split()) >= 300]
    vocab = sorted({w for text in base[:20] for w in text.split()})
    records = [{"id": f"b{i}", "text": t} for i, t in enumerate(base)]
    near = []
    for j in range(copies):
        i = rng.randrange(len(base))
        r = rng.uniform(*rate) if isinstance(rate, tuple) else rate
        text = edit_words(base[i], r, rng, vocab)
        text = text.upper() if rng.random() < 0.3 else text + (BOILERPLATE if rng.random() < 0.7 else "")
        near.append({"id": f"n{j}-b{i}", "text": text})
    rng.shuffle(near)
    path.write_text("".join(json.dumps(r) + "\n" for r in records + near), encoding="utf-8")
    return {"base": [r["id"] for r in records], "near": [r["id"] for r in near]}


def score(base: set[str], near: list[str], kept: set[str]) -> tuple[float, float, int]:
    """``(recall, precision, wrongly removed)`` of near dedup, whichever member of a group it keeps.

    A scene and its copies form a group that should shrink to one document (datatrove keeps the root of
    its union-find, not always the earliest). Removals beyond that, and any removal from a scene without
    copies, are wrong.
    """
    groups: dict[str, list[str]] = {b: [b] for b in base}
    for n in near:
        groups[n.split("-", 1)[1]].append(n)
    right = wrong = 0
    for members in groups.values():
        gone = sum(m not in kept for m in members)
        right += min(gone, len(members) - 1)
        wrong += gone - min(gone, len(members) - 1)
    removed = right + wrong
    return right / len(near), (right / removed if removed else 1.0), wrong


RULES_OFF = {n: {"enabled": False} for n in ("language", "gopher_repetition", "gopher_quality", "c4", "fineweb", "pii")}
PROFILES = {
    "5-gram 14x8 (FineWeb)": {"ngram": 5, "bands": 14, "rows": 8, "min_similarity": 0.0},
    "3-gram 20x5, min_sim 0.3": {"ngram": 3, "bands": 20, "rows": 5, "min_similarity": 0.3},
    "2-gram 20x5, min_sim 0.3": {"ngram": 2, "bands": 20, "rows": 5, "min_similarity": 0.3},
}
PEER_PROFILES = ("5-gram 14x8 (FineWeb)", "3-gram 20x5, min_sim 0.3")


def recall(args: argparse.Namespace) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix="lmforge-recall-bench-", dir=args.scratch))
    rates: list[float | tuple[float, float]] = [(0.01, 0.05), 0.01, 0.02, 0.03, 0.05, 0.10, 0.15, 0.20]
    rows = []
    try:
        for k, rate in enumerate(rates):
            corpus = scratch / f"planted-{k}.jsonl"
            roles = planted_corpus(corpus, rate, args.seed + k, args.copies)
            base, near = set(roles["base"]), roles["near"]
            label = f"{rate[0]:.0%}-{rate[1]:.0%}" if isinstance(rate, tuple) else f"{rate:.0%}"
            for name, profile in PROFILES.items():
                impls = ["ours"] + (["datatrove"] if args.peer == "datatrove" and name in PEER_PROFILES else [])
                for impl in impls:
                    # datatrove has no min_similarity check: its LSH candidates are all merged
                    prof = {k: v for k, v in profile.items() if impl == "ours" or k != "min_similarity"}
                    out = scratch / f"out-{k}-{impl}-{len(rows)}"
                    spec = {
                        "corpus": str(corpus),
                        "out": str(out),
                        "preset": args.preset,
                        "overrides": {**RULES_OFF, "min_words": 0, "min_chars": 0, "near_dedup": prof},
                        "rules": False,
                        "kept_ids": True,
                    }
                    run = measure(impl, spec)
                    shutil.rmtree(out, ignore_errors=True)
                    rec, prec, false = score(base, near, set(run["kept_ids"]))
                    rows.append(
                        {
                            "edit_rate": label,
                            "profile": name,
                            "impl": impl,
                            "recall": rec,
                            "precision": prec,
                            "wrongly_removed": false,
                        }
                    )
                    print(f"{label:>7} {name:<28} {impl:<10} recall {rec:.2f} precision {prec:.3f}", file=sys.stderr)
        print(f"\n{len(base)} distinct scenes + {args.copies} near copies per edit rate (seeded)\n")
        print(
            text_table(
                ["edit rate", "profile", "impl", "recall", "precision", "wrongly removed"],
                [
                    [r["edit_rate"], r["profile"], r["impl"], r["recall"], r["precision"], r["wrongly_removed"]]
                    for r in rows
                ],
            )
        )
        note = "datatrove has no min_similarity check: it merges every LSH candidate of the profile"
        return {
            "distinct_docs": len(base),
            "copies_per_rate": args.copies,
            "profiles": PROFILES,
            "note": note,
            "rows": rows,
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def workers(args: argparse.Namespace) -> dict[str, Any]:
    """``clean_shard`` on 1 and on N processes, and N shared-nothing 1-process runs, ``--repeat`` rounds.

    A round runs 1, N, N, 1 processes (``ABBA``: a drift of the machine's speed within the round cancels
    in the ratio of the sums), then the peer: N ``clean_shard`` runs at once, each on its own 1/N stripe
    of the corpus with one process: what N processes that share nothing reach on this machine at that
    moment, the ceiling of any pool.
    """
    from lmforge.cpus import available_cpus

    n = args.workers or available_cpus()
    scratch = Path(tempfile.mkdtemp(prefix="lmforge-workers-bench-", dir=args.scratch))
    try:
        corpus = scratch / "corpus.jsonl"
        docs, size = build_corpus(corpus, args.mb, args.edit_rate, args.seed)

        def shard_run(count: int, index: int = 0, of: int = 1) -> dict[str, Any]:
            out = scratch / f"out-{count}-{index}-{of}"
            overrides = {"language": {"enabled": False}, "workers": count}
            spec = {"corpus": str(corpus), "out": str(out), "preset": args.preset, "overrides": overrides,
                    "shard": [index, of]}  # fmt: skip
            run = measure("shard", spec)
            shutil.rmtree(out, ignore_errors=True)
            return run

        rounds = []
        for rep in range(args.repeat):
            row: dict[str, Any] = {"round": rep + 1, "load_start": load_average()[0]}
            order = (1, n, n, 1)
            runs = [(count, shard_run(count)) for count in order]
            for count in (1, n):
                mine = [run for c, run in runs if c == count]
                row[f"wall_s_{count}"] = [run["wall_s"] for run in mine]
                row[f"docs_per_s_{count}"] = len(mine) * docs / sum(row[f"wall_s_{count}"])
                row[f"peak_tree_rss_mb_{count}"] = max(run["peak_tree_rss_mb"] for run in mine)
            row["docs_out"] = sorted({int(run["metrics"]["docs_out"]) for _, run in runs})  # one value: same output
            with ThreadPoolExecutor(n) as pool:
                stripes = list(pool.map(lambda index: shard_run(1, index, n), range(n)))
            row["wall_s_stripes"] = max(r["wall_s"] for r in stripes)
            row["docs_per_s_stripes"] = docs / row["wall_s_stripes"]
            row["speedup"] = row[f"docs_per_s_{n}"] / row["docs_per_s_1"]
            row["stripes_speedup"] = row["docs_per_s_stripes"] / row["docs_per_s_1"]
            row["of_ceiling"] = row[f"docs_per_s_{n}"] / row["docs_per_s_stripes"]
            row["load_end"] = load_average()[0]
            rounds.append(row)
            print(
                f"round {rep + 1}: {row['docs_per_s_1']:.0f} docs/s on 1 process, {row[f'docs_per_s_{n}']:.0f} on "
                f"{n}: {row['speedup']:.2f}x; {n} shared-nothing stripes {row['stripes_speedup']:.2f}x "
                f"(the pool reaches {row['of_ceiling']:.2f} of it; load {row['load_start']:.1f}-{row['load_end']:.1f})",
                flush=True,
            )

        def median(key: str) -> float:
            values = sorted(r[key] for r in rounds)
            return values[len(values) // 2]

        return {"corpus_mb": size / 1e6, "docs_in": docs, "workers": n, "rounds": rounds,
                "median_speedup": median("speedup"), "median_stripes_speedup": median("stripes_speedup"),
                "median_of_ceiling": median("of_ceiling")}  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def memory(args: argparse.Namespace) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix="lmforge-memory-bench-", dir=args.scratch))
    try:
        corpus = scratch / "corpus.jsonl"
        print(f"writing a {args.mb:.0f} MB corpus to {corpus} ...", file=sys.stderr, flush=True)
        docs, size = build_corpus(corpus, args.mb, args.edit_rate, args.seed)
        overrides = {"language": {"enabled": False}} if args.no_langid else {}
        spec = {"corpus": str(corpus), "out": str(scratch / "out"), "preset": args.preset, "overrides": overrides}
        spec["rules"] = True
        print("cleaning ...", file=sys.stderr, flush=True)
        run = measure("ours", spec, sample_s=2.0)
        m = run["metrics"]
        samples = run["rss_samples_mb"]
        row = {
            "corpus_mb": size / 1e6,
            "docs_in": docs,
            "docs_out": int(m["docs_out"]),
            "language_id": not args.no_langid,
            "wall_s": run["process_s"],
            "docs_per_s": docs / run["process_s"],
            "mb_per_s": size / 1e6 / run["process_s"],
            "peak_rss_mb": run["peak_rss_mb"],
            "peak_sampled_rss_mb": run["peak_tree_rss_mb"],
            # every 2 s; thinned to at most 60 points for the record
            "rss_samples_mb": samples[:: max(1, len(samples) // 60)],
        }
        print(text_table(["metric", "value"], [[k, v] for k, v in row.items() if k != "rss_samples_mb"]))
        return row
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        kind, spec_path, result_file = sys.argv[2:5]
        spec = json.loads(Path(spec_path).read_text())
        children = {"ours": child_ours, "shard": child_shard, "dedup": child_dedup_step, "datatrove": child_datatrove}
        children["synth"] = lambda spec: {
            "shards": synthetic_signature_shards(Path(spec["root"]), spec["docs"], spec["shards"], spec["seed"])
        }
        result = children[kind](spec)
        Path(result_file).write_text(json.dumps(result))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "section", nargs="?", default="throughput", choices=["throughput", "recall", "memory", "workers", "dedup"]
    )
    parser.add_argument("--mb", type=float, default=None, help="corpus size in MB (50; memory: 1024)")
    parser.add_argument("--edit-rate", type=float, default=0.03, help="fraction of words substituted per copy")
    parser.add_argument("--peer", choices=["datatrove"], default=None, help="also run the same work in datatrove")
    parser.add_argument(
        "--no-langid", action="store_true", help="throughput: skip ours with lingua; memory: run without it"
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs per row; the fastest is reported (workers: rounds)")
    parser.add_argument("--workers", type=int, default=0, help="workers: processes against 1 (0: the CPUs available)")
    parser.add_argument("--copies", type=int, default=200, help="recall: near copies per edit rate")
    parser.add_argument("--preset", default="tiny-cpu")
    parser.add_argument("--docs", type=int, default=1_000_000, help="dedup: synthetic documents")
    parser.add_argument("--groups", type=int, default=4, help="dedup: LSH band groups")
    parser.add_argument("--parts", type=int, default=1, help="dedup: hash parts per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scratch", default=None, help="directory for the corpus and outputs (default: $TMPDIR)")
    parser.add_argument("--json", type=Path, default=None, help="output JSON (default: bench/results/data_*.json)")
    args = parser.parse_args()
    if args.mb is None:
        args.mb = 1024.0 if args.section == "memory" else 50.0
    section = {"throughput": throughput, "recall": recall, "memory": memory, "workers": workers,
               "dedup": dedup_memory}[args.section]  # fmt: skip
    started = machine_facts()
    body = section(args)
    name = {"throughput": "data_bench", "recall": "data_recall", "memory": "data_memory", "workers": "data_workers",
            "dedup": "data_dedup_memory"}[args.section]  # fmt: skip
    path = args.json or result_path(name)
    versions = package_versions("datatrove", "lingua-language-detector", "numpy", "xxhash", "spacy")
    record = {"versions": versions, "args": vars(args) | {"json": str(path)}, **body}
    print(f"\nwrote {write_results(name, record, path=path, machine=started)}")


if __name__ == "__main__":
    main()
