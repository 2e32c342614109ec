"""Pretraining throughput and MFU of the shared loop: tokens/s and MFU per configuration, as a table and JSON.

CPU (always): the ``tiny-cpu`` model shape, fp32 vs bf16 autocast, with and without gradient
checkpointing, one process vs 2-rank DDP (torchrun, gloo). GPU (when one is present): ``gpt2-124m``
in bf16 with TF32 and ``torch.compile``.

MFU needs a peak: on a GPU the bf16 data-sheet figure (:mod:`lmforge.train.mfu`); on the CPU the fp32
matmul rate measured here (``--peak-flops`` overrides it), so CPU MFU reads "fraction of this
machine's GEMM speed".

    python -m bench.pretrain_bench [--steps 12] [--json out.json]

``--reference`` instead compares lmforge's loop with a plain eager PyTorch GPT-2 loop written here (SDPA
causal attention, tanh-GELU, AdamW(0.9, 0.95), clip 1.0) at 4 layers x 4 heads x 256 wide, context 256,
batch 8, vocabulary 8192, fp32 on the CPU: every run in a fresh process, reference and lmforge
alternating, the ratio lmforge/reference per round; ``--variants`` names the speed-up combinations.

    python -m bench.pretrain_bench --reference --rounds 3 --steps 12 --variants lmforge,before
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import cpu_flags, load_average, machine_facts, text_table, write_results
from lmforge.config import ModelConfig, TrainConfig
from lmforge.model.build import build_model, set_gpt2_activation
from lmforge.stages import resolve_config
from lmforge.train.batches import random_windows
from lmforge.train.distributed import distributed_context
from lmforge.train.loop import lr_at, train
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


# -- lmforge's loop against a textbook eager GPT-2 loop (--reference) ---------------------------------------
# The shape of the comparison: GPT-2, 4 layers, 4 heads, 256 wide, context 256, micro-batch 8, vocabulary 8192.
REF_SHAPE = {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 256, "batch_size": 8, "vocab": 8192}
REF_WARMUP_STEPS = 2  # steps per run left out of tokens/s (allocation; with compile, compilation)
# Each variant switches lmforge's speed-ups on or off; "before" is the loop as it was before them.
VARIANTS: dict[str, dict[str, Any]] = {
    "before": {
        "gelu": "gelu_new",
        "fused_optimizer": False,
        "prefetch_batches": 0,
        "compile": False,
        "fused_ce": False,
    },
    "+fused_gelu": {
        "gelu": "gelu_pytorch_tanh",
        "fused_optimizer": False,
        "prefetch_batches": 0,
        "compile": False,
        "fused_ce": False,
    },
    "+fused_adamw": {
        "gelu": "gelu_new",
        "fused_optimizer": True,
        "prefetch_batches": 0,
        "compile": False,
        "fused_ce": False,
    },
    "+prefetch": {
        "gelu": "gelu_new",
        "fused_optimizer": False,
        "prefetch_batches": 2,
        "compile": False,
        "fused_ce": False,
    },
    "+fused_ce": {
        "gelu": "gelu_new",
        "fused_optimizer": False,
        "prefetch_batches": 0,
        "compile": False,
        "fused_ce": True,
    },
    "+compile": {
        "gelu": "gelu_new",
        "fused_optimizer": False,
        "prefetch_batches": 0,
        "compile": True,
        "fused_ce": False,
    },
    "lmforge": {
        "gelu": "gelu_pytorch_tanh",
        "fused_optimizer": True,
        "prefetch_batches": 2,
        "compile": False,
        "fused_ce": True,
    },
    "lmforge+compile": {
        "gelu": "gelu_pytorch_tanh",
        "fused_optimizer": True,
        "prefetch_batches": 2,
        "compile": True,
        "fused_ce": True,
    },
}


class RefBlock(torch.nn.Module):
    """One pre-norm GPT-2 block: causal SDPA attention and a tanh-GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.fc, self.out = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class RefGPT(torch.nn.Module):
    """The textbook GPT-2: token + position embeddings, blocks, final norm, head tied to the embedding."""

    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, width), torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList(RefBlock(width, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)
        for name, param in self.named_parameters():
            if param.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                torch.nn.init.normal_(param, std=std)
            elif name.endswith("bias"):
                torch.nn.init.zeros_(param)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T


def _ref_tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, REF_SHAPE["vocab"], 2_000_000).astype(np.uint16)


def _ref_train_cfg(steps: int, variant: dict[str, Any]) -> TrainConfig:
    return TrainConfig(
        max_steps=steps, batch_size=REF_SHAPE["batch_size"], seq_len=REF_SHAPE["block_size"], lr=6e-4, min_lr=6e-5,
        warmup_steps=1, weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0, precision="fp32",
        eval_interval=steps, eval_batches=1, log_interval=REF_WARMUP_STEPS, seed=0,
        fused_optimizer=variant["fused_optimizer"], prefetch_batches=variant["prefetch_batches"],
        compile=variant["compile"],
    )  # fmt: skip


def reference_run(steps: int) -> dict[str, float]:
    """The textbook eager loop: AdamW(0.9, 0.95), weight decay on matrices, clip 1.0, the same schedule and data."""
    cfg = _ref_train_cfg(steps, VARIANTS["before"])
    torch.manual_seed(0)
    s = REF_SHAPE
    model = RefGPT(s["vocab"], s["block_size"], s["n_embd"], s["n_layer"], s["n_head"])
    decay = [p for p in model.parameters() if p.dim() >= 2 and p is not model.wte.weight]
    rest = [p for p in model.parameters() if not any(p is d for d in decay)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    tokens = _ref_tokens()
    timed_seconds, loss = 0.0, float("nan")
    for step in range(steps):
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = random_windows(tokens, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed, step=step)
        logits = model(batch["input_ids"])
        loss_t = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), batch["targets"].reshape(-1))
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_t.item()
        if step >= REF_WARMUP_STEPS:
            timed_seconds += time.perf_counter() - start
    timed_tokens = (steps - REF_WARMUP_STEPS) * cfg.batch_size * cfg.seq_len
    return {"tokens_per_sec": timed_tokens / timed_seconds, "final_loss": loss}


def lmforge_run(steps: int, variant: dict[str, Any]) -> dict[str, float]:
    """lmforge's ``train()`` on the reference shape with ``variant``'s speed-ups; tokens/s after the warm-up steps.

    The history logs every ``REF_WARMUP_STEPS`` steps; the windows after the first cover the same steps the
    reference times, and their tokens are equal, so the run's rate is the harmonic mean of theirs.
    """
    cfg = _ref_train_cfg(steps, variant)
    s = REF_SHAPE
    model_cfg = ModelConfig(arch="gpt2", n_layer=s["n_layer"], n_head=s["n_head"], n_embd=s["n_embd"],
                            block_size=s["block_size"], dropout=0.0)  # fmt: skip
    model = build_model(model_cfg, s["vocab"], eos_id=0, pad_id=1, seed=0)
    set_gpt2_activation(model, variant["gelu"])
    tokens = _ref_tokens()

    def batch(step: int, micro: int) -> dict[str, torch.Tensor]:
        return random_windows(tokens, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed, step=step)

    loss_fn = functools.partial(causal_lm_loss, fused_ce=variant["fused_ce"])
    history = train(model, cfg, loss_fn, batch, lambda: [batch(0, 0)], desc="bench")
    rates = history["tokens_per_sec"][1:]
    return {
        "tokens_per_sec": len(rates) / sum(1.0 / r for r in rates),
        "final_loss": history["train_loss"][-1],
        "compile_seconds": history["warmup_seconds"],
    }


def reference_worker(args: argparse.Namespace) -> None:
    """One measurement in a fresh process (so that allocator, thread pools and compile caches start cold)."""
    if args.ref_worker == "reference":
        result = reference_run(args.steps)
    else:
        result = lmforge_run(args.steps, VARIANTS[args.ref_worker])
    Path(args.worker_out).write_text(json.dumps(result))


def _measure(name: str, steps: int, scratch: Path, threads: int | None) -> dict[str, float]:
    out = scratch / f"{name}.json"
    env = {**os.environ, "TQDM_DISABLE": "1"} | ({"OMP_NUM_THREADS": str(threads)} if threads else {})
    subprocess.run(
        [sys.executable, "-m", __spec__.name, "--ref-worker", name, "--steps", str(steps), "--worker-out", str(out)],
        check=True, env=env, capture_output=True,
    )  # fmt: skip
    return json.loads(out.read_text())


def reference_comparison(steps: int, rounds: int, variants: list[str], threads: int | None) -> dict[str, Any]:
    """Alternate reference and lmforge runs ``rounds`` times; the ratio lmforge/reference per round and variant.

    Every lmforge variant is paired with a reference run right before it, so that both see the same load.
    """
    per_round: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(rounds):
            row: dict[str, Any] = {"round": round_index + 1, "load_start": load_average()[0]}
            for name in variants:
                reference = _measure("reference", steps, Path(scratch), threads)
                ours = _measure(name, steps, Path(scratch), threads)
                row[name] = {**ours, "reference_tokens_per_sec": reference["tokens_per_sec"],
                             "reference_final_loss": reference["final_loss"],
                             "ratio": ours["tokens_per_sec"] / reference["tokens_per_sec"]}  # fmt: skip
                print(
                    f"round {round_index + 1} {name:<16} {ours['tokens_per_sec']:8.0f} tokens/s vs reference "
                    f"{reference['tokens_per_sec']:8.0f}: {row[name]['ratio']:.3f}x (load {load_average()[0]:.2f})",
                    flush=True,
                )
            row["load_end"] = load_average()[0]
            per_round.append(row)
    summary = {
        name: {
            "ratios": [r[name]["ratio"] for r in per_round],
            "median_ratio": float(np.median([r[name]["ratio"] for r in per_round])),
            "median_tokens_per_sec": float(np.median([r[name]["tokens_per_sec"] for r in per_round])),
        }
        for name in variants
    }
    return {"shape": REF_SHAPE, "steps": steps, "timed_steps": steps - REF_WARMUP_STEPS, "rounds": per_round,
            "summary": summary}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per configuration")
    parser.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s per device for MFU")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--reference", action="store_true", help="only the comparison with a textbook eager GPT-2 loop (fp32, CPU)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="--reference: alternating rounds")
    parser.add_argument(
        "--threads", type=int, default=None, help="--reference: torch threads of every run (default: torch's)"
    )
    parser.add_argument("--variants", default="lmforge", help=f"--reference: comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ref-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ref_worker:
        reference_worker(args)
        return
    if args.worker_out:
        ddp_worker(args)
        return
    machine = _machine()  # before the runs: the load they ran under
    if args.reference:
        report = reference_comparison(args.steps, args.rounds, args.variants.split(","), args.threads)
        report["torch_threads"] = args.threads or torch.get_num_threads()
        for name, row in report["summary"].items():
            ratios = ", ".join(f"{r:.3f}" for r in row["ratios"])
            print(f"{name:<16} median {row['median_ratio']:.3f}x of the reference (rounds: {ratios})")
        if args.json:
            write_results("pretrain_reference", report, path=args.json, machine=machine)
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
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone"]
        subprocess.run(
            [*torchrun, "-m", __spec__.name, "--steps", str(args.steps), "--peak-flops", str(cpu_peak / 2),
             "--worker-out", str(out)],
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

    cells = [
        [
            row["model"],
            str(row["device"])[:14],
            row["ranks"],
            row["precision"],
            "on" if row["grad_ckpt"] else "off",
            f"{row['tokens_per_sec']:.0f}",
            f"{100 * row['mfu']:.1f}%",
            f"{row['final_loss']:.3f}",
        ]
        for row in rows
    ]
    header = ["model", "device", "ranks", "prec", "gc", "tokens/s", "MFU", "loss"]
    print(text_table(header, cells, widths=[10, 14, 5, 5, 5, 10, 7, 7], align="<<>>>>>>", sep=" ", rule=True))
    machine |= {"torch_threads": threads, "cpu_fp32_matmul_flops": cpu_peak}
    report = {"steps": args.steps, "rows": rows}
    print(json.dumps({"machine": machine, **report}, indent=1))
    if args.json:
        write_results("pretrain_bench", report, path=args.json, machine=machine)


def _machine() -> dict[str, Any]:
    """The machine facts plus whether the CPU has native bf16 (AVX-512 BF16 or AMX)."""
    return machine_facts() | {"native_bf16": bool({"avx512_bf16", "amx_bf16"} & cpu_flags())}


if __name__ == "__main__":
    main()
