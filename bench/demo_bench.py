"""What the lm-evaluation-harness tasks cost the demo: `lmforge run` (tiny-cpu) without them, then with them.

The two demos run back to back, each in its own process and output folder, as a user types them; the record has
each one's wall time, its ``evaluate`` step's time (from the step's log) and the load averages around it.

    python -m bench.demo_bench            # writes bench/results/demo_harness_<UTC date>.json

``--evaluate-only RUN`` times the ``evaluate`` step alone instead, without then with the harness, on the artifacts
of a finished demo run (``RUN``: the run's folder that holds ``evaluate/``, ``distill/``, ...): the harness's cost
in seconds, in a few minutes where two whole demos take too long.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import RESULTS, load_average, machine_facts, write_results

VARIANTS: dict[str, list[str]] = {
    "harness off": ["--set", "evaluate.harness.enabled=false"],
    "harness on (default)": [],
}
SUMMARY_LINES = ("lmforge run", "harness", "verdict")
_STAMP = re.compile(r"^(\d\d):(\d\d):(\d\d)")


def _step_seconds(log: Path) -> float | None:
    """Seconds between the first and the last ``HH:MM:SS`` stamped line of a step's log."""
    stamps = [m for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if (m := _STAMP.match(line))]
    if len(stamps) < 2:
        return None
    first, last = ((int(h) * 3600 + int(m) * 60 + int(s)) for h, m, s in (stamps[0].groups(), stamps[-1].groups()))
    return float((last - first) % 86400)


def run_demo(extra: list[str], out: Path) -> dict[str, Any]:
    """One ``lmforge run -q`` into ``out``: its wall time, the evaluate step's time, the load before and after, and
    its last lines about the harness and the verdict."""
    load_before = load_average()
    start = time.perf_counter()
    command = [sys.executable, "-m", "lmforge", "run", "-q", "-o", str(out), *extra]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
    evaluate_logs = sorted(out.glob("runs/*/logs/*evaluate*"))
    return {
        "args": extra,
        "returncode": done.returncode,
        "wall_s": round(seconds, 1),
        "evaluate_s": _step_seconds(evaluate_logs[0]) if evaluate_logs else None,
        "load_before": load_before,
        "load_after": load_average(),
        "summary": [line for line in done.stdout.splitlines() if line.startswith(SUMMARY_LINES)],
    }


EVALUATE_INPUTS = {
    "shards": "tokenize/shards",
    "base": "pretrain/model",
    "teacher": "finetune-lora/merged_model",
    "student": "distill/student",
    "onnx_fp32": "export-onnx/onnx_model",
    "int8_dynamic": "quantize-int8/int8_dynamic",
    "int8_qdq": "quantize-int8/int8_qdq",
    "engine": "build-tensorrt/engine",
    "cleaned": "merge-shards/cleaned",
}


def run_evaluate(extra: list[str], run: Path, out: Path) -> dict[str, Any]:
    """``lmforge stage evaluate`` on a finished demo's artifacts into ``out``: its wall time and the load around it."""
    io = [f"--io={name}={run / rel}" for name, rel in EVALUATE_INPUTS.items()]
    command = [sys.executable, "-m", "lmforge", "stage", "evaluate", *io, "--io=qa_uri=demo://chatterbot"]
    load_before = load_average()
    start = time.perf_counter()
    done = subprocess.run([*command, f"--io=evaluation={out}", *extra], check=False, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
    return {
        "args": extra,
        "returncode": done.returncode,
        "wall_s": round(seconds, 1),
        "load_before": load_before,
        "load_after": load_average(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/demo_harness_<date>)")
    parser.add_argument("--evaluate-only", type=Path, default=None, metavar="RUN", help="time evaluate alone on RUN")
    args = parser.parse_args()
    machine = machine_facts()
    runs = {}
    with tempfile.TemporaryDirectory(prefix="lmforge-demo-bench-") as tmp:
        for i, (name, extra) in enumerate(VARIANTS.items()):
            if args.evaluate_only:
                runs[name] = run_evaluate(extra, args.evaluate_only.resolve(), Path(tmp) / str(i))
            else:
                runs[name] = run_demo(extra, Path(tmp) / str(i))
            print(f"{name}: {runs[name]}", flush=True)
    off, on = runs["harness off"]["wall_s"], runs["harness on (default)"]["wall_s"]
    payload = {
        "step": "evaluate" if args.evaluate_only else "lmforge run",
        "runs": runs,
        "harness_s": round(on - off, 1),
    }
    if not args.evaluate_only:
        payload["harness_overhead"] = round(on / off - 1, 4)
    day = datetime.now(UTC).strftime("%Y-%m-%d")
    path = args.out or RESULTS / f"demo_harness{'_evaluate' if args.evaluate_only else ''}_{day}.json"
    path = write_results("demo_harness", payload, path=path, machine=machine)
    print(f"the harness adds {payload['harness_s']} s to {payload['step']}; written {path}")


if __name__ == "__main__":
    main()
