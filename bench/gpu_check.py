"""The GPU check: every figure that needs a CUDA device, in one run, as one JSON record.

Rows (each in a child process of its own with a time limit, so that one failure or hang costs only its row):

* ``gpu_tests`` — the ``gpu``-marked tests (``pytest -m gpu``): passed, failed, skipped;
* ``mfu_*`` — tokens/s and MFU of the ``gpt2-124m`` shape in bf16, 20 optimizer steps on random tokens through
  lmforge's training loop: ``torch`` backend with ``torch.compile`` off and on, DeepSpeed ZeRO-2 and ZeRO-3 and
  FSDP2 (each a one-rank group on the one device). DDP needs a second device to differ from the single-process
  row; that row says so;
* ``generate`` — ``transformers`` greedy generation of the ``gpt2-124m`` shape (random weights) on the GPU,
  batch 1, 8 and 32, 32 new tokens: generated tokens/s;
* ``serve`` — ``bench.serve_bench`` (decode and batched modes, short) when ONNX Runtime has a CUDA execution
  provider, otherwise the reason;
* ``tensorrt`` — the TensorRT version when ``tensorrt`` imports (its engine build runs in ``gpu_tests``),
  otherwise the reason.

On a machine without a CUDA device every GPU row reads ``skipped: no CUDA device`` and the check exits 0.

    bash bench/gpu_check.sh                  # the whole check; JSON to stdout and bench/results/gpu_check.json
    python -m bench.gpu_check --row mfu_compile_off   # one row (what the check runs in each child)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import machine_facts, result_path, write_results

NO_CUDA = "skipped: no CUDA device"
REPO = Path(__file__).resolve().parent.parent
MFU_STEPS = 20
GENERATE_TOKENS = 32
# Seconds each row may take: together well under the 8 minutes the check may run on one GPU.
ROW_LIMITS: dict[str, int] = {
    "gpu_tests": 120,
    "mfu_compile_off": 45,
    "mfu_compile_on": 80,
    "mfu_zero2": 45,
    "mfu_zero3": 45,
    "mfu_ddp": 5,
    "mfu_fsdp2": 30,
    "generate": 40,
    "serve": 50,
    "tensorrt": 15,
}


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (imported here only, so the parent process stays light)."""
    import torch

    return torch.cuda.is_available()


def _mfu(backend: str, *, compile_: bool = False, zero_stage: int | None = None) -> dict[str, Any]:
    """Tokens/s, MFU and peak memory of ``gpt2-124m`` in bf16 through lmforge's loop on the one device."""
    import torch

    from bench.pretrain_bench import run_one
    from lmforge.stages import resolve_config

    base = resolve_config("gpt2-124m").pretrain
    update: dict[str, Any] = {"grad_accum": 1, "compile": compile_, "batch_size": 16, "precision": "bf16"}
    distributed = base.train.distributed.model_copy(update={"backend": backend})
    if zero_stage is not None:
        deepspeed = distributed.deepspeed.model_copy(
            update={"zero": distributed.deepspeed.zero.model_copy(update={"stage": zero_stage})}
        )
        distributed = distributed.model_copy(update={"deepspeed": deepspeed})
    cfg = base.train.model_copy(update={**update, "distributed": distributed})
    if backend in ("deepspeed", "fsdp2"):  # both run in a process group, here of one rank
        from lmforge.train.distributed import distributed_context

        with distributed_context(cfg.distributed) as ctx:
            result = run_one(base.model, cfg, MFU_STEPS, None, dist_ctx=ctx)
    else:
        result = run_one(base.model, cfg, MFU_STEPS, None)
    return {"device": torch.cuda.get_device_name(), "steps": MFU_STEPS, **result}


def _generate() -> dict[str, Any]:
    """Greedy ``generate`` tokens/s of the ``gpt2-124m`` shape (random weights) at batch 1, 8 and 32."""
    import torch

    from lmforge.model.build import build_model
    from lmforge.stages import resolve_config

    model = build_model(resolve_config("gpt2-124m").pretrain.model, 50304, eos_id=0, pad_id=1, seed=0)
    model = model.to("cuda", torch.bfloat16).eval()
    rows = {}
    for batch in (1, 8, 32):
        prompt = torch.randint(2, 50000, (batch, 32), device="cuda")
        kwargs = {"max_new_tokens": GENERATE_TOKENS, "min_new_tokens": GENERATE_TOKENS, "do_sample": False}
        model.generate(prompt, **kwargs)  # warm-up: kernels, allocator
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(prompt, **kwargs)
        torch.cuda.synchronize()
        rows[f"batch_{batch}_tokens_per_sec"] = batch * GENERATE_TOKENS / (time.perf_counter() - start)
    return rows


def _gpu_tests() -> dict[str, Any]:
    """Run the ``gpu``-marked tests and count their outcomes from pytest's closing line."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "--no-header", "-rs"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    counts = {key: int(n) for n, key in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", proc.stdout)}
    return {"exit_code": proc.returncode, **counts, "tail": proc.stdout.strip().splitlines()[-5:]}


def _serve() -> dict[str, Any]:
    """The serve bench, short, when ONNX Runtime can run on the GPU."""
    import onnxruntime

    providers = onnxruntime.get_available_providers()
    if "CUDAExecutionProvider" not in providers:
        return {"status": f"skipped: onnxruntime {onnxruntime.__version__} has no CUDAExecutionProvider ({providers})"}
    out = Path(os.environ.get("OUT", REPO / "bench" / "results")) / "serve_gpu.json"
    subprocess.run(
        [sys.executable, "-m", "bench.serve_bench", "--modes", "decode", "batched", "--rounds", "1",
         "--requests", "32", "--duration-s", "15", "--out", str(out)],
        cwd=REPO, check=True, capture_output=True,
    )  # fmt: skip
    return {"status": "ran", "record": str(out)}


def _tensorrt() -> dict[str, Any]:
    """The TensorRT version, or why it cannot be used."""
    try:
        import tensorrt
    except ImportError as exc:
        return {"status": f"skipped: tensorrt does not import ({exc}); the engine build needs the tensorrt image"}
    return {"status": "available", "version": tensorrt.__version__}


ROWS: dict[str, Callable[[], dict[str, Any]]] = {
    "gpu_tests": _gpu_tests,
    "mfu_compile_off": lambda: _mfu("torch"),
    "mfu_compile_on": lambda: _mfu("torch", compile_=True),
    "mfu_zero2": lambda: _mfu("deepspeed", zero_stage=2),
    "mfu_zero3": lambda: _mfu("deepspeed", zero_stage=3),
    "mfu_ddp": lambda: {"status": "skipped: one device; DDP over one rank is the mfu_compile_off row"},
    "mfu_fsdp2": lambda: _mfu("fsdp2"),
    "generate": _generate,
    "serve": _serve,
    "tensorrt": _tensorrt,
}


def run_row(name: str) -> dict[str, Any]:
    """One row in a child process with its time limit; its JSON, or why it has none."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "bench.gpu_check", "--row", name],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=ROW_LIMITS[name],
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"status": f"failed: over its {ROW_LIMITS[name]} s limit"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": f"failed: exit {proc.returncode}: {last[:300]}"}
    row = json.loads(lines[-1])
    row.setdefault("status", "ran")
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def check(rows: list[str]) -> dict[str, Any]:
    """Every row asked for: each skipped at once without a CUDA device, else run in its child."""
    has_cuda = cuda_available()
    results = {name: (run_row(name) if has_cuda else {"status": NO_CUDA}) for name in rows}
    return {"cuda": has_cuda, "rows": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", choices=sorted(ROWS), help="run one row in this process and print its JSON")
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS), help="rows of the check")
    parser.add_argument("--out", type=Path, default=result_path("gpu_check"), help="where the record is written")
    args = parser.parse_args()
    if args.row:
        print(json.dumps(ROWS[args.row]()))
        return
    machine = machine_facts()  # before the rows: the load they ran under
    path = write_results("gpu_check", check(args.rows), path=args.out, machine=machine)
    print(path.read_text(encoding="utf-8").strip())


if __name__ == "__main__":
    main()
