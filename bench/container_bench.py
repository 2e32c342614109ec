"""A stage in its image against the same stage in this Python: ``lmforge stage`` timed both ways, alternating.

The peer is the subprocess runner's way (this Python with the host's packages); the container runs the stage as
``lmforge run --runner podman`` runs a task: the image's user, a read-only root file system, a writable ``/tmp``,
no network, the run's folder bind-mounted at its own path. The inputs are made once on the host (``clean``,
``tokenize`` of the demo corpus). Each round runs every stage both ways, the order swapped from round to round, so
both see the same load; the record has every run's wall time and the container/host ratio per stage.

    python -m bench.container_bench --rounds 3     # writes bench/results/container_stages_<UTC date>.json

Needs the images of this code (``make local-images``) and podman (or ``--engine docker``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import load_average, machine_facts, text_table, write_results
from lmforge_kfp.containers import IMAGE_UID

REPO = Path(__file__).resolve().parents[1]
PRETRAIN_STEPS = 40


def stage_args(stage: str, work: Path, out: str) -> list[str]:
    """``lmforge stage`` arguments of ``stage`` reading the prepared inputs in ``work`` and writing ``out``."""
    if stage == "clean":
        return ["clean", "--io", "corpus_uri=demo://shakespeare", "--io", f"cleaned={work / out}"]
    if stage == "pretrain":
        return [
            "pretrain",
            "--io", f"shards={work / 'shards'}",
            "--io", f"tokenizer={work / 'tokenizer'}",
            "--io", f"model={work / out}",
            "--set", f"pretrain.train.max_steps={PRETRAIN_STEPS}",
            "--set", f"pretrain.train.eval_interval={PRETRAIN_STEPS}",
        ]  # fmt: skip
    raise ValueError(f"no benchmark arguments for stage {stage!r}")


def prepare_inputs(work: Path) -> None:
    """The demo corpus cleaned and tokenized on the host: what ``pretrain`` reads."""
    host = [sys.executable, "-m", "lmforge", "stage"]
    subprocess.run([*host, *stage_args("clean", work, "cleaned")], check=True, capture_output=True)
    tokenize = ["tokenize", "--io", f"cleaned={work / 'cleaned'}", "--io", f"tokenizer={work / 'tokenizer'}"]
    subprocess.run([*host, *tokenize, "--io", f"shards={work / 'shards'}"], check=True, capture_output=True)


def container_command(engine: str, image: str, work: Path) -> list[str]:
    """``engine run`` as the container runner starts a task (lmforge_kfp.containers.run_container)."""
    user = f"{IMAGE_UID}:{IMAGE_UID}" if os.geteuid() == 0 else f"{os.getuid()}:{os.getgid()}"
    return [
        engine, "run", "--rm", "--read-only", "--tmpfs", "/tmp:rw,exec,size=4g", "--user", user,
        "--network", "none", "-v", f"{work}:{work}", image, "lmforge", "stage",
    ]  # fmt: skip


def timed(command: list[str]) -> float:
    """Wall seconds of ``command``; its output shown only when it fails."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:12])} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds


def run_rounds(engine: str, stages: list[str], rounds: int, work: Path) -> list[dict[str, Any]]:
    """Every stage on the host and in its image, ``rounds`` times, the order swapped each round."""
    from lmforge_kfp.components.images import content_tag, image_for, with_tag

    if os.geteuid() == 0:  # the images' user owns the run's folder, as the container runner hands it over
        for path in [work, *work.rglob("*")]:
            os.lchown(path, IMAGE_UID, IMAGE_UID)
    runs = []
    for round_no in range(rounds):
        for stage in stages:
            image = with_tag(image_for(stage), content_tag())
            ways = {
                "host": [sys.executable, "-m", "lmforge", "stage"],
                "container": container_command(engine, image, work),
            }
            order = ["host", "container"] if round_no % 2 == 0 else ["container", "host"]
            for way in order:
                out = f"{stage}-{way}-{round_no}"
                load = load_average()
                seconds = timed([*ways[way], *stage_args(stage, work, out)])
                runs.append({"stage": stage, "way": way, "round": round_no, "seconds": round(seconds, 2), "load": load})
                print(f"round {round_no} {stage:<9} {way:<9} {seconds:7.1f} s  load {load[0]:.2f}", flush=True)
    return runs


def summarize(runs: list[dict[str, Any]], stages: list[str]) -> list[dict[str, Any]]:
    """Per stage: the median wall time each way and the container/host ratio of the medians."""
    rows = []
    for stage in stages:
        median = {
            way: statistics.median(r["seconds"] for r in runs if r["stage"] == stage and r["way"] == way)
            for way in ("host", "container")
        }
        ratio = median["container"] / median["host"]
        rows.append({"stage": stage, "host_s": median["host"], "container_s": median["container"], "ratio": ratio})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="Rounds of every stage both ways.")
    parser.add_argument("--stages", default="clean,pretrain", help="Comma-separated stages: clean, pretrain.")
    parser.add_argument("--engine", default="podman", choices=["podman", "docker"])
    args = parser.parse_args(argv)
    os.environ.setdefault("CONTAINERS_CONF", str(REPO / "images" / "containers.conf"))
    stages = args.stages.split(",")
    machine = machine_facts()
    with tempfile.TemporaryDirectory(prefix="lmforge-container-bench-") as folder:
        work = Path(folder)
        prepare_inputs(work)
        runs = run_rounds(args.engine, stages, args.rounds, work)
    rows = summarize(runs, stages)
    print(text_table(["stage", "host s", "container s", "container/host"],
                     [[r["stage"], r["host_s"], r["container_s"], r["ratio"]] for r in rows]))  # fmt: skip
    day = datetime.now(UTC).strftime("%Y-%m-%d")
    payload = {"engine": args.engine, "pretrain_steps": PRETRAIN_STEPS, "runs": runs, "summary": rows}
    print(write_results(f"container_stages_{day}", payload, machine=machine))


if __name__ == "__main__":
    main()
