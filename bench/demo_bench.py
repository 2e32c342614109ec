"""What the lm-evaluation-harness tasks cost the demo: `lmforge run` (tiny-cpu) without them, then with them.

The two demos run back to back, each in its own process and output folder, as a user types them; the record has
each one's wall time, its ``evaluate`` step's time (from the step's log) and the load averages around it.

    python -m bench.demo_bench            # writes bench/results/demo_harness_<UTC date>.json
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/demo_harness_<date>)")
    args = parser.parse_args()
    machine = machine_facts()
    runs = {}
    with tempfile.TemporaryDirectory(prefix="lmforge-demo-bench-") as tmp:
        for i, (name, extra) in enumerate(VARIANTS.items()):
            runs[name] = run_demo(extra, Path(tmp) / str(i))
            print(f"{name}: {runs[name]}", flush=True)
    off, on = runs["harness off"]["wall_s"], runs["harness on (default)"]["wall_s"]
    payload = {"runs": runs, "harness_overhead": round(on / off - 1, 4)}
    day = datetime.now(UTC).strftime("%Y-%m-%d")
    path = args.out or RESULTS / f"demo_harness_{day}.json"
    path = write_results("demo_harness", payload, path=path, machine=machine)
    print(f"harness adds {payload['harness_overhead']:.1%} to the demo's wall time; written {path}")


if __name__ == "__main__":
    main()
