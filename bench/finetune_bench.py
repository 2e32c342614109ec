"""Fine-tuning and distillation benchmarks: LoRA vs full fine-tuning, chunked vs naive KD loss, KD vs CE.

Each measurement runs in a fresh subprocess so that peak RSS (``ru_maxrss``) belongs to that run alone.

    python bench/finetune_bench.py                       # all sections, JSON to bench/finetune_bench.json
    python bench/finetune_bench.py --sections lora,kd    # a subset
    python bench/finetune_bench.py --sections kd_vs_ce --kd-steps 200

Sections:
* ``lora``: the same GPT-2 shape (default 12 layers × 768, GPT-2's 50257 vocabulary, randomly initialized)
  trained a few steps at the same batch with LoRA (the ``seeds`` preset: r 64, alpha 16) and in full;
  peak RSS and tokens/s through the shared training loop.
* ``kd``: one distillation step (teacher forward, student forward/backward) with
  :class:`~lmforge.train.losses.ChunkedKDLoss` vs the autograd reference :func:`~lmforge.train.losses.kd_loss`
  on full logits; tokens/s and peak RSS.
* ``kd_vs_ce``: a teacher pretrained on the demo corpus, then the same random-init student trained with
  KD (alpha 0.5, T 2) and with CE only (alpha 0), same steps, data and seed; held-out perplexity of each.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# --------------------------------------------------------------------------- children (run in a subprocess)


def child_lora(args: dict[str, Any]) -> dict[str, Any]:
    import peft
    import torch

    from lmforge.config import LoraConfig, ModelConfig, TrainConfig
    from lmforge.model.build import build_model, count_parameters
    from lmforge.train import lora
    from lmforge.train.loop import tokens_per_sec, train
    from lmforge.train.losses import causal_lm_loss

    torch.set_num_threads(args["threads"])
    baseline = _peak_rss_mb()
    shape = ModelConfig(arch="gpt2", n_layer=args["layers"], n_head=args["heads"], n_embd=args["width"], block_size=256)
    model = build_model(shape, args["vocab"], eos_id=0, pad_id=0, seed=0)
    if args["mode"] == "lora":
        cfg = LoraConfig(preset="seeds", dropout=0.0)
        model = peft.get_peft_model(model, lora.peft_config(cfg, model, lora.target_modules(model, None)))
    trainable, total = count_parameters(model, trainable_only=True), count_parameters(model)
    tcfg = TrainConfig(
        max_steps=args["steps"], batch_size=args["batch"], seq_len=args["seq"], lr=1e-4, min_lr=1e-5,
        warmup_steps=0, precision="fp32", eval_interval=10_000, eval_batches=1, log_interval=10_000,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, args["vocab"], (args["batch"], args["seq"] + 1), generator=gen)
    data = {"input_ids": batch[:, :-1], "targets": batch[:, 1:]}
    history = train(model, tcfg, causal_lm_loss, lambda s, m: data, lambda: [data], desc=args["mode"])
    return {
        "mode": args["mode"],
        "parameters": total,
        "trainable": trainable,
        "tokens_per_sec": tokens_per_sec(history),
        "peak_rss_mb": _peak_rss_mb(),
        "rss_after_imports_mb": baseline,
    }


def child_kd(args: dict[str, Any]) -> dict[str, Any]:
    import torch

    from lmforge.config import ModelConfig
    from lmforge.model.build import build_model
    from lmforge.train.losses import ChunkedKDLoss, kd_loss

    torch.set_num_threads(args["threads"])
    torch.manual_seed(0)
    shape = ModelConfig(arch="gpt2", n_layer=4, n_head=4, n_embd=args["width"], block_size=256)
    teacher = build_model(shape, args["vocab"], eos_id=0, pad_id=0, seed=0).eval().requires_grad_(False)
    student = build_model(shape.model_copy(update={"n_layer": 2}), args["vocab"], eos_id=0, pad_id=0, seed=1)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4)
    ids = torch.randint(0, args["vocab"], (args["batch"], args["seq"] + 1))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    chunked = ChunkedKDLoss(temperature=2.0, alpha=0.5, chunk_tokens=args["chunk"])

    def step() -> float:
        with torch.no_grad():
            t_logits = teacher(input_ids=inputs).logits
        s_logits = student(input_ids=inputs).logits
        loss_start = time.perf_counter()
        if args["mode"] == "chunked":
            loss = chunked(s_logits, t_logits, labels).total
        else:
            loss = kd_loss(s_logits, t_logits, labels, temperature=2.0, alpha=0.5)[0]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - loss_start

    step()  # warm-up
    start = time.perf_counter()
    loss_seconds = sum(step() for _ in range(args["steps"]))
    elapsed = time.perf_counter() - start
    tokens = args["steps"] * args["batch"] * args["seq"]
    return {
        "mode": args["mode"],
        "tokens_per_sec": tokens / elapsed,
        "loss_and_backward_share": loss_seconds / elapsed,
        "peak_rss_mb": _peak_rss_mb(),
    }


def child_kd_vs_ce(args: dict[str, Any]) -> dict[str, Any]:
    import torch

    from lmforge.config import DistillConfig, ModelConfig, PretrainConfig, TrainConfig
    from lmforge.train import distill, pretrain

    torch.set_num_threads(args["threads"])
    work = Path(args["workdir"])
    shards, tokenizer = Path(args["shards"]), Path(args["tokenizer"])
    teacher_dir = work / "teacher"
    shape = ModelConfig(arch="gpt2", n_layer=4, n_head=4, n_embd=128, block_size=128)

    def loop(steps: int, lr: float) -> TrainConfig:
        return TrainConfig(
            max_steps=steps, batch_size=16, seq_len=128, lr=lr, min_lr=lr / 10, warmup_steps=min(20, steps // 10),
            precision="fp32", eval_interval=steps, eval_batches=8, log_interval=max(1, steps // 4),
        )  # fmt: skip

    start = time.perf_counter()
    teacher = pretrain.run(PretrainConfig(model=shape, train=loop(args["teacher_steps"], 3e-3)), shards, tokenizer,
                           teacher_dir).metrics  # fmt: skip
    results: dict[str, Any] = {"teacher_val_perplexity": teacher["val_perplexity"], "arms": {}}
    for name, alpha in (("kd", 0.5), ("ce", 0.0)):
        cfg = DistillConfig(init="random", alpha=alpha, temperature=2.0, train=loop(args["student_steps"], 3e-3))
        metrics = distill.run(cfg, teacher_dir, shards, work / f"student-{name}").metrics
        results["arms"][name] = {k: metrics[k] for k in ("student_val_loss", "student_val_perplexity", "kl")}
    kd, ce = (results["arms"][k]["student_val_perplexity"] for k in ("kd", "ce"))
    results["kd_vs_ce_perplexity_reduction"] = 1 - kd / ce
    results["seconds"] = time.perf_counter() - start
    return results


CHILDREN = {"lora": child_lora, "kd": child_kd, "kd_vs_ce": child_kd_vs_ce}


# --------------------------------------------------------------------------- parent


def _spawn(kind: str, args: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, json.dumps(args)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _demo_shards(workdir: Path, scenes: int) -> tuple[Path, Path]:
    """Tokenizer (2048 BPE) and token shards of the first ``scenes`` demo Shakespeare scenes (every 10th to val)."""
    import itertools

    import numpy as np

    from lmforge.artifacts import write_manifest
    from lmforge.data.demo import shakespeare_documents
    from lmforge.data.shards import ShardWriter
    from lmforge.data.tokenizer import tokenizer_fingerprint, train_bpe_tokenizer
    from lmforge.model.build import load_tokenizer

    docs = [d["text"] for d in itertools.islice(shakespeare_documents(), scenes)]
    tok_dir, shards = workdir / "tokenizer", workdir / "shards"
    tok = train_bpe_tokenizer(docs, vocab_size=2048, min_frequency=2, eos_token="<|endoftext|>", pad_token="<|pad|>")
    tok.save_pretrained(tok_dir)
    write_manifest(tok_dir, "tokenizer")
    tok = load_tokenizer(tok_dir)
    writer = ShardWriter(
        shards,
        vocab_size=len(tok),
        eos_id=tok.eos_token_id,
        tokenizer_sha256=tokenizer_fingerprint(tok_dir),
        shard_tokens=50_000_000,
    )
    for i, text in enumerate(docs):
        writer.add_document("val" if i % 10 == 0 else "train", np.array(tok(text)["input_ids"] + [tok.eos_token_id]))
    writer.close()
    write_manifest(shards, "token-shards")
    return tok_dir, shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="lora,kd,kd_vs_ce")
    parser.add_argument("--threads", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--kd-width", type=int, default=128)
    parser.add_argument("--kd-batch", type=int, default=8)
    parser.add_argument("--kd-seq", type=int, default=128)
    parser.add_argument("--teacher-steps", type=int, default=600)
    parser.add_argument("--student-steps", type=int, default=150)
    parser.add_argument("--scenes", type=int, default=300)
    parser.add_argument("--json", type=Path, default=HERE / "finetune_bench.json")
    args = parser.parse_args()
    sections = args.sections.split(",")
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {args.threads} threads",
        "python": platform.python_version(),
    }

    if "lora" in sections:
        common = {k: getattr(args, k) for k in ("threads", "layers", "width", "vocab", "batch", "seq", "steps")}
        common["heads"] = max(1, args.width // 64)
        runs = {mode: _spawn("lora", common | {"mode": mode}) for mode in ("full", "lora")}
        runs["lora_over_full_peak_rss"] = runs["lora"]["peak_rss_mb"] / runs["full"]["peak_rss_mb"]
        report["lora_vs_full"] = runs | {"setup": common}
        print(f"\nLoRA vs full fine-tuning: gpt2 {args.layers}x{args.width}, vocab {args.vocab}, batch {args.batch}x"
              f"{args.seq}, fp32, {args.steps} steps")  # fmt: skip
        print(f"{'mode':6} {'trainable':>12} {'peak RSS MB':>12} {'tokens/s':>10}")
        for mode in ("full", "lora"):
            r = runs[mode]
            print(f"{mode:6} {r['trainable']:>12,} {r['peak_rss_mb']:>12.0f} {r['tokens_per_sec']:>10.1f}")
        print(f"LoRA peak / full peak = {runs['lora_over_full_peak_rss']:.2f}")

    if "kd" in sections:
        common = {
            "threads": args.threads, "width": args.kd_width, "vocab": args.vocab, "batch": args.kd_batch,
            "seq": args.kd_seq, "steps": args.steps, "chunk": 256,
        }  # fmt: skip
        runs = {mode: _spawn("kd", common | {"mode": mode}) for mode in ("naive", "chunked")}
        runs["chunked_speedup"] = runs["chunked"]["tokens_per_sec"] / runs["naive"]["tokens_per_sec"]
        report["kd_loss"] = runs | {"setup": common}
        print(f"\nDistillation step, 4-layer teacher -> 2-layer student, width {args.kd_width}, vocab {args.vocab}, "
              f"batch {args.kd_batch}x{args.kd_seq}")  # fmt: skip
        print(f"{'loss':8} {'tokens/s':>10} {'loss share':>11} {'peak RSS MB':>12}")
        for mode in ("naive", "chunked"):
            r = runs[mode]
            print(
                f"{mode:8} {r['tokens_per_sec']:>10.1f} {r['loss_and_backward_share']:>11.0%} {r['peak_rss_mb']:>12.0f}"
            )
        print(f"chunked / naive tokens/s = {runs['chunked_speedup']:.2f}")

    if "kd_vs_ce" in sections:
        with tempfile.TemporaryDirectory(prefix="lmforge-bench-") as tmp:
            tok_dir, shards = _demo_shards(Path(tmp), args.scenes)
            result = _spawn(
                "kd_vs_ce",
                {
                    "threads": args.threads, "workdir": tmp, "shards": str(shards), "tokenizer": str(tok_dir),
                    "teacher_steps": args.teacher_steps, "student_steps": args.student_steps,
                },
            )  # fmt: skip
        report["kd_vs_ce"] = result | {"teacher_steps": args.teacher_steps, "student_steps": args.student_steps}
        print(f"\nKD vs CE on {args.scenes} demo scenes: teacher 4x128 pretrained {args.teacher_steps} steps "
              f"(val ppl {result['teacher_val_perplexity']:.1f}); 2-layer random-init students, "
              f"{args.student_steps} steps each")  # fmt: skip
        for name in ("kd", "ce"):
            arm = result["arms"][name]
            print(f"{name:3} val loss {arm['student_val_loss']:.4f}  perplexity {arm['student_val_perplexity']:.2f}")
        print(f"KD perplexity is {result['kd_vs_ce_perplexity_reduction']:.1%} lower than CE-only")

    args.json.write_text(json.dumps(report, indent=2), encoding="utf-8")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        import logging

        logging.disable(logging.INFO)
        os.environ.setdefault("TQDM_DISABLE", "1")
        print(json.dumps(CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))))
    else:
        main()
