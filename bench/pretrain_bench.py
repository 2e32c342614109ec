"""Pretraining throughput and MFU of the shared loop: tokens/s and MFU per configuration, as a table and JSON.

CPU (always): the ``tiny-cpu`` model shape, fp32 vs bf16 autocast, with and without gradient
checkpointing, one process vs 2-rank DDP (torchrun, gloo). GPU (when one is present): ``gpt2-124m``
in bf16 with TF32 and ``torch.compile``.

MFU needs a peak: on a GPU the bf16 data-sheet figure (:mod:`lmforge.train.mfu`); on the CPU the fp32
matmul rate measured here (``--peak-flops`` overrides it), so CPU MFU reads "fraction of this
machine's GEMM speed".

    python bench/pretrain_bench.py [--steps 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from lmforge.config import ModelConfig, TrainConfig, resolve_config
from lmforge.model.build import build_model
from lmforge.train.batches import random_windows
from lmforge.train.distributed import distributed_context
from lmforge.train.loop import train
from lmforge.train.losses import causal_lm_loss
from lmforge.train.mfu import device_peak_flops, model_flops_per_token

VOCAB = 2048


def measured_matmul_flops(n: int = 1024, repeats: int = 10) -> float:
    """fp32 GEMM FLOP/s of this process (its thread count), best of ``repeats``."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def run_one(
    model_cfg: ModelConfig, train_cfg: TrainConfig, steps: int, peak: float | None, dist_ctx=None
) -> dict[str, float]:
    """Train ``steps`` steps on random tokens; tokens/s and MFU over the steps after the first two."""
    ctx_device = dist_ctx.device if dist_ctx else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(model_cfg, VOCAB, eos_id=0, pad_id=1, seed=0).to(ctx_device)
    tokens = np.random.default_rng(0).integers(0, VOCAB, 2_000_000).astype(np.uint16)
    rank, world = (dist_ctx.rank, dist_ctx.world_size) if dist_ctx else (0, 1)

    def batch(step: int, micro: int):
        return random_windows(
            tokens, batch_size=train_cfg.batch_size, seq_len=train_cfg.seq_len, seed=0, step=step,
            micro=micro, grad_accum=train_cfg.grad_accum, rank=rank, world_size=world,
        )  # fmt: skip

    cfg = train_cfg.model_copy(
        update={"max_steps": steps, "warmup_steps": 1, "log_interval": 1, "eval_interval": steps, "eval_batches": 1}
    )
    history = train(
        model,
        cfg,
        causal_lm_loss,
        batch,
        lambda: [batch(0, 0)],
        dist=dist_ctx,
        flops_per_token=model_flops_per_token(model, cfg.seq_len),
        desc="bench",
    )
    timed = slice(2, None)  # the first steps pay for allocation and (with compile) compilation
    tokens_per_sec = float(np.mean(history["tokens_per_sec"][timed]))
    flops = model_flops_per_token(model, cfg.seq_len)
    peak = device_peak_flops(ctx_device, peak)
    return {
        "tokens_per_sec": tokens_per_sec,
        "mfu": tokens_per_sec * flops / (peak * world) if peak else float("nan"),
        "final_loss": history["train_loss"][-1],
        "memory_gb": max(history["memory_gb"]),
    }


def ddp_worker(args: argparse.Namespace) -> None:
    """One rank of the DDP measurement (started by torchrun); rank 0 writes the result JSON."""
    base = resolve_config("tiny-cpu").pretrain
    cfg = base.train.model_copy(update={"precision": "fp32", "batch_size": base.train.batch_size // 2})
    with distributed_context(cfg.distributed) as ctx:
        result = run_one(base.model, cfg, args.steps, args.peak_flops, dist_ctx=ctx)
        if ctx.is_main:
            Path(args.worker_out).write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per configuration")
    parser.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s per device for MFU")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_out:
        ddp_worker(args)
        return

    threads = torch.get_num_threads()
    cpu_peak = args.peak_flops or measured_matmul_flops()
    base = resolve_config("tiny-cpu").pretrain
    rows: list[dict[str, object]] = []
    for precision in ("fp32", "bf16"):
        for checkpointing in (False, True):
            cfg = base.train.model_copy(update={"precision": precision, "grad_checkpointing": checkpointing})
            result = run_one(base.model, cfg, args.steps, cpu_peak)
            rows.append({"model": "tiny-cpu", "device": "cpu", "ranks": 1, "precision": precision,
                         "grad_ckpt": checkpointing, **result})  # fmt: skip

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch, "ddp.json")
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, threads // 2)), "TQDM_DISABLE": "1"}
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", __file__,
             "--steps", str(args.steps), "--peak-flops", str(cpu_peak / 2), "--worker-out", str(out)],
            check=True, env=env, capture_output=True,
        )  # fmt: skip
        rows.append({"model": "tiny-cpu", "device": "cpu", "ranks": 2, "precision": "fp32", "grad_ckpt": False,
                     **json.loads(out.read_text())})  # fmt: skip

    if torch.cuda.is_available():
        gpt2 = resolve_config("gpt2-124m").pretrain
        for compile_ in (False, True):
            cfg = gpt2.train.model_copy(update={"grad_accum": 1, "compile": compile_, "batch_size": 16})
            result = run_one(gpt2.model, cfg, max(args.steps, 20), args.peak_flops)
            rows.append({"model": "gpt2-124m", "device": torch.cuda.get_device_name(), "ranks": 1,
                         "precision": "bf16", "grad_ckpt": False, "compile": compile_, **result})  # fmt: skip

    header = f"{'model':<10} {'device':<14} {'ranks':>5} {'prec':>5} {'gc':>5} {'tokens/s':>10} {'MFU':>7} {'loss':>7}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['model']:<10} {str(row['device'])[:14]:<14} {row['ranks']:>5} {row['precision']:>5} "
            f"{'on' if row['grad_ckpt'] else 'off':>5} {row['tokens_per_sec']:>10.0f} "
            f"{100 * row['mfu']:>6.1f}% {row['final_loss']:>7.3f}"
        )
    report = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "torch_threads": threads,
            "cpu_fp32_matmul_flops": cpu_peak,
            "torch": torch.__version__,
        },
        "date": time.strftime("%Y-%m-%d"),
        "steps": args.steps,
        "rows": rows,
    }
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
