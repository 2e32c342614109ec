"""Fine-tuning and distillation benchmarks: LoRA vs full fine-tuning, chunked vs naive KD loss, and the two
quality figures on the demo data (LoRA held-out answer loss, KD vs CE-only student perplexity).

Each measurement runs in a fresh subprocess so that peak RSS (``ru_maxrss``) belongs to that run alone.

    python -m bench.finetune_bench                            # all sections
    python -m bench.finetune_bench --sections lora,kd         # a subset
    python -m bench.finetune_bench --sections lora_demo,kd_vs_ce --seeds 1337,1,2

Results are merged into ``--json`` (default ``bench/results/finetune_bench.json``) section by section, so
sections run separately accumulate there.

Sections:
* ``lora``: the same GPT-2 shape (default 12 layers × 768, GPT-2's 50257 vocabulary, randomly initialized)
  trained a few steps at the same batch with LoRA (the ``seeds`` preset: r 64, alpha 16) and in full;
  peak RSS and tokens/s through the shared training loop.
* ``kd``: one distillation step (teacher forward, student forward/backward) with
  :class:`~lmforge.train.losses.ChunkedKDLoss` vs the autograd reference :func:`~lmforge.train.losses.kd_loss`
  on full logits; tokens/s and peak RSS.
* ``lora_demo``: the demo base (the preset's ``pretrain`` on the demo Shakespeare scenes, tokenizer trained on
  them), then the preset's ``finetune_lora`` stage on ``demo://chatterbot`` once per seed; held-out answer loss
  of the base and of the tuned model.
* ``kd_vs_ce``: the same demo base as teacher (``--teacher-steps`` to pretrain it longer), then the preset's
  ``distill`` stage twice per seed and student initialization: KD (the preset's alpha and temperature) and
  CE only (alpha 0). Within a pair only the loss differs: same student init, steps, batches and seed.
  Held-out perplexity of each student on the Shakespeare validation split.
* ``kd_mixture``: task-aware distillation. The demo base tuned by the preset's ``finetune_lora`` on
  ``demo://chatterbot`` is the teacher; the preset's ``distill`` stage runs three arms per seed, same steps,
  batches and student init: KD on the mixture of corpus windows and fine-tuning examples (the preset's
  ``qa_fraction``), KD on corpus windows only (``qa_fraction`` 0), and CE only
  on the mixture (``alpha`` 0). Held-out answer loss (the Q&A pairs LoRA held out) and corpus perplexity (the
  Shakespeare validation split) of each student, next to the teacher's.

The ``lora_demo``, ``kd_vs_ce`` and ``kd_mixture`` sections share one tokenizer, shard set and base model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import machine_facts, peak_rss_mb, result_path, text_table, write_results

# --------------------------------------------------------------------------- children (run in a subprocess)


def child_lora(args: dict[str, Any]) -> dict[str, Any]:
    import peft
    import torch

    from lmforge.config import LoraConfig, ModelConfig, TrainConfig
    from lmforge.model.build import build_model, count_parameters
    from lmforge.train import finetune_lora
    from lmforge.train.loop import tokens_per_sec, train
    from lmforge.train.losses import causal_lm_loss

    torch.set_num_threads(args["threads"])
    baseline = peak_rss_mb()
    shape = ModelConfig(arch="gpt2", n_layer=args["layers"], n_head=args["heads"], n_embd=args["width"], block_size=256)
    model = build_model(shape, args["vocab"], eos_id=0, pad_id=0, seed=0)
    if args["mode"] == "lora":
        cfg = LoraConfig(preset="seeds", dropout=0.0)
        model = peft.get_peft_model(
            model, finetune_lora.peft_config(cfg, model, finetune_lora.target_modules(model, None))
        )
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
        "peak_rss_mb": peak_rss_mb(),
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
        "peak_rss_mb": peak_rss_mb(),
    }


def child_pretrain(args: dict[str, Any]) -> dict[str, Any]:
    import torch

    from lmforge.stages import resolve_stage_config
    from lmforge.train import pretrain

    torch.set_num_threads(args["threads"])
    overrides = {"train.max_steps": args["steps"]} if args["steps"] else {}
    cfg = resolve_stage_config("pretrain", args["preset"], overrides)
    start = time.perf_counter()
    metrics = pretrain.run(cfg, shards=args["shards"], tokenizer=args["tokenizer"], model=args["output"]).metrics
    return {
        "steps": cfg.train.max_steps,
        "val_loss": metrics["val_loss"],
        "val_perplexity": metrics["val_perplexity"],
        "seconds": time.perf_counter() - start,
    }


def child_lora_demo(args: dict[str, Any]) -> dict[str, Any]:
    import torch

    from lmforge.stages import resolve_stage_config
    from lmforge.train import finetune_lora

    torch.set_num_threads(args["threads"])
    work = Path(args["workdir"])
    seeds: dict[str, Any] = {}
    for seed in args["seeds"]:
        cfg = resolve_stage_config("finetune_lora", args["preset"], {"train.seed": seed})
        start = time.perf_counter()
        metrics = finetune_lora.run(
            cfg,
            base_model=args["base"],
            qa_uri=args["qa"],
            adapter=work / f"adapter-{seed}",
            merged_model=work / f"merged-{seed}",
        ).metrics
        keys = ("base_heldout_loss", "tuned_heldout_loss", "heldout_loss_reduction", "train_loss", "trainable_fraction")
        seeds[str(seed)] = {k: metrics[k] for k in keys} | {"seconds": time.perf_counter() - start}
    config = cfg.model_dump(mode="json", exclude={"train"}) | {"train": cfg.train.model_dump(exclude={"seed"})}
    reductions = [r["heldout_loss_reduction"] for r in seeds.values()]
    return {"seeds": seeds, "min_reduction": min(reductions), "config": config}


def child_kd_vs_ce(args: dict[str, Any]) -> dict[str, Any]:
    import torch

    from lmforge.stages import resolve_stage_config
    from lmforge.train import distill

    torch.set_num_threads(args["threads"])
    work = Path(args["workdir"])
    preset = resolve_stage_config("distill", args["preset"])
    results: dict[str, Any] = {"alpha": preset.alpha, "temperature": preset.temperature, "inits": {}}
    for init in args["inits"]:
        runs: dict[str, Any] = {}
        for seed in args["seeds"]:
            pair: dict[str, Any] = {}
            for arm, alpha in (("kd", preset.alpha), ("ce", 0.0)):
                overrides: dict[str, Any] = {"init": init, "alpha": alpha, "train.seed": seed}
                if args["steps"]:
                    overrides["train.max_steps"] = args["steps"]
                cfg = resolve_stage_config("distill", args["preset"], overrides)
                start = time.perf_counter()
                out = work / f"student-{init}-{seed}-{arm}"
                metrics = distill.run(cfg, teacher=args["teacher"], shards=args["shards"], student=out).metrics
                keys = ("student_val_loss", "student_val_perplexity", "teacher_val_perplexity", "kl")
                pair[arm] = {k: metrics[k] for k in keys} | {"seconds": time.perf_counter() - start}
            pair["kd_vs_ce_perplexity_reduction"] = (
                1 - pair["kd"]["student_val_perplexity"] / pair["ce"]["student_val_perplexity"]
            )
            runs[str(seed)] = pair
        reductions = [r["kd_vs_ce_perplexity_reduction"] for r in runs.values()]
        results["inits"][init] = {"seeds": runs, "min_reduction": min(reductions), "steps": cfg.train.max_steps}
    return results


def child_kd_mixture(args: dict[str, Any]) -> dict[str, Any]:
    import torch

    from lmforge.stages import resolve_stage_config
    from lmforge.train import distill, finetune_lora

    torch.set_num_threads(args["threads"])
    work = Path(args["workdir"])
    teacher = work / "mixture-teacher"
    tuned = finetune_lora.run(
        resolve_stage_config("finetune_lora", args["preset"]),
        base_model=args["base"], qa_uri=args["qa"], adapter=work / "mixture-adapter", merged_model=teacher,
    ).metrics  # fmt: skip
    preset = resolve_stage_config("distill", args["preset"])
    arms = {
        "kd_mixture": {"qa_fraction": preset.qa_fraction or 0.5},
        "kd_corpus_only": {"qa_fraction": 0.0},
        "ce_mixture": {"qa_fraction": preset.qa_fraction or 0.5, "alpha": 0.0},
    }
    runs: dict[str, Any] = {}
    for seed in args["seeds"]:
        by_arm: dict[str, Any] = {}
        for arm, overrides in arms.items():
            fields = overrides | {"train.seed": seed} | ({"train.max_steps": args["steps"]} if args["steps"] else {})
            cfg = resolve_stage_config("distill", args["preset"], fields)
            start = time.perf_counter()
            result = distill.run(cfg, teacher=teacher, shards=args["shards"], student=work / f"mix-{seed}-{arm}")
            keys = (
                "student_heldout_answer_loss", "teacher_heldout_answer_loss", "student_val_perplexity",
                "teacher_val_perplexity",
            )  # fmt: skip
            by_arm[arm] = {k: result.metrics[k] for k in keys} | {"seconds": time.perf_counter() - start}
        runs[str(seed)] = by_arm
    means = {
        arm: {
            key: sum(r[arm][key] for r in runs.values()) / len(runs)
            for key in ("student_heldout_answer_loss", "student_val_perplexity")
        }
        for arm in arms
    }
    return {
        "teacher_lora": {k: tuned[k] for k in ("base_heldout_loss", "tuned_heldout_loss")},
        "arms": {
            arm: {"qa_fraction": o["qa_fraction"], "alpha": o.get("alpha", preset.alpha)} for arm, o in arms.items()
        },
        "steps": cfg.train.max_steps,
        "seeds": runs,
        "means": means,
    }


CHILDREN = {
    "lora": child_lora,
    "kd": child_kd,
    "pretrain": child_pretrain,
    "lora_demo": child_lora_demo,
    "kd_vs_ce": child_kd_vs_ce,
    "kd_mixture": child_kd_mixture,
}


# --------------------------------------------------------------------------- parent


def _spawn(kind: str, args: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", __spec__.name, "--child", kind, json.dumps(args)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"bench child {kind!r} failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _demo_shards(workdir: Path, scenes: int) -> tuple[Path, Path]:
    """Tokenizer (2048 BPE) and token shards of the first ``scenes`` (0: all) demo Shakespeare scenes, every 10th
    scene to the validation split; the raw scenes, without the ``clean`` stage."""
    import itertools

    from lmforge.data.demo import shakespeare_documents
    from tests.support.demo_artifacts import write_shards, write_tokenizer

    docs = [d["text"] for d in itertools.islice(shakespeare_documents(), scenes or None)]
    tok_dir = write_tokenizer(docs, workdir / "tokenizer", vocab_size=2048)
    write_shards(docs, tok_dir, workdir / "shards", shard_tokens=50_000_000)
    return tok_dir, workdir / "shards"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="lora,kd,lora_demo,kd_vs_ce,kd_mixture")
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
    parser.add_argument("--preset", default="tiny-cpu", help="Preset whose pretrain/finetune_lora/distill run.")
    parser.add_argument("--teacher-steps", type=int, default=0, help="Demo base pretrain steps (0: the preset's).")
    parser.add_argument("--student-steps", type=int, default=0, help="Distillation steps (0: the preset's).")
    parser.add_argument("--seeds", default="1337,1,2", help="Training seeds of lora_demo and kd_vs_ce.")
    parser.add_argument("--kd-inits", default="random,teacher_layers", help="Student initializations for kd_vs_ce.")
    parser.add_argument("--scenes", type=int, default=0, help="Demo scenes for the base (0: all).")
    parser.add_argument("--json", type=Path, default=result_path("finetune_bench"))
    args = parser.parse_args()
    sections = args.sections.split(",")
    seeds = [int(seed) for seed in args.seeds.split(",")]
    machine = machine_facts() | {"threads": args.threads}
    report: dict[str, Any] = {}

    if "lora" in sections:
        common = {k: getattr(args, k) for k in ("threads", "layers", "width", "vocab", "batch", "seq", "steps")}
        common["heads"] = max(1, args.width // 64)
        runs = {mode: _spawn("lora", common | {"mode": mode}) for mode in ("full", "lora")}
        runs["lora_over_full_peak_rss"] = runs["lora"]["peak_rss_mb"] / runs["full"]["peak_rss_mb"]
        report["lora_vs_full"] = runs | {"setup": common, "machine": machine}
        print(f"\nLoRA vs full fine-tuning: gpt2 {args.layers}x{args.width}, vocab {args.vocab}, batch {args.batch}x"
              f"{args.seq}, fp32, {args.steps} steps")  # fmt: skip
        cells = []
        for mode in ("full", "lora"):
            r = runs[mode]
            cells.append([mode, f"{r['trainable']:,}", f"{r['peak_rss_mb']:.0f}", f"{r['tokens_per_sec']:.1f}"])
        print(text_table(["mode", "trainable", "peak RSS MB", "tokens/s"], cells, widths=[6, 12, 12, 10], sep=" "))
        print(f"LoRA peak / full peak = {runs['lora_over_full_peak_rss']:.2f}")

    if "kd" in sections:
        common = {
            "threads": args.threads, "width": args.kd_width, "vocab": args.vocab, "batch": args.kd_batch,
            "seq": args.kd_seq, "steps": args.steps, "chunk": 256,
        }  # fmt: skip
        runs = {mode: _spawn("kd", common | {"mode": mode}) for mode in ("naive", "chunked")}
        runs["chunked_speedup"] = runs["chunked"]["tokens_per_sec"] / runs["naive"]["tokens_per_sec"]
        report["kd_loss"] = runs | {"setup": common, "machine": machine}
        print(f"\nDistillation step, 4-layer teacher -> 2-layer student, width {args.kd_width}, vocab {args.vocab}, "
              f"batch {args.kd_batch}x{args.kd_seq}")  # fmt: skip
        cells = []
        for mode in ("naive", "chunked"):
            r = runs[mode]
            cells.append(
                [mode, f"{r['tokens_per_sec']:.1f}", f"{r['loss_and_backward_share']:.0%}", f"{r['peak_rss_mb']:.0f}"]
            )
        print(text_table(["loss", "tokens/s", "loss share", "peak RSS MB"], cells, widths=[8, 10, 11, 12], sep=" "))
        print(f"chunked / naive tokens/s = {runs['chunked_speedup']:.2f}")

    if {"lora_demo", "kd_vs_ce", "kd_mixture"} & set(sections):
        with tempfile.TemporaryDirectory(prefix="lmforge-bench-") as tmp:
            tok_dir, shards = _demo_shards(Path(tmp), args.scenes)
            base = Path(tmp, "base")
            common = {"threads": args.threads, "preset": args.preset, "seeds": seeds, "workdir": tmp}
            pretrained = _spawn(
                "pretrain",
                {"threads": args.threads, "preset": args.preset, "steps": args.teacher_steps, "shards": str(shards),
                 "tokenizer": str(tok_dir), "output": str(base)},
            )  # fmt: skip
            print(f"\nDemo base: {args.preset} pretrain, {pretrained['steps']} steps on "
                  f"{args.scenes or 'all'} demo scenes: val perplexity {pretrained['val_perplexity']:.1f} "
                  f"({pretrained['seconds']:.0f} s)")  # fmt: skip
            if "lora_demo" in sections:
                result = _spawn("lora_demo", common | {"base": str(base), "qa": "demo://chatterbot"})
                report["lora_demo"] = {"base": pretrained, **result, "machine": machine}
                print(f"LoRA on demo://chatterbot ({args.preset} finetune_lora): held-out answer loss")
                for seed, r in result["seeds"].items():
                    print(f"  seed {seed:>5}: {r['base_heldout_loss']:.4f} -> {r['tuned_heldout_loss']:.4f} "
                          f"({r['heldout_loss_reduction']:.1%} lower, {r['seconds']:.0f} s)")  # fmt: skip
            if "kd_vs_ce" in sections:
                inits = args.kd_inits.split(",")
                result = _spawn(
                    "kd_vs_ce",
                    common | {"teacher": str(base), "shards": str(shards), "inits": inits, "steps": args.student_steps},
                )
                report["kd_vs_ce"] = {"teacher": pretrained, **result, "machine": machine}
                print(f"KD (alpha {result['alpha']}, T {result['temperature']}) vs CE-only students of that teacher "
                      "(val perplexity on the held-out scenes)")  # fmt: skip
                for init, by_init in result["inits"].items():
                    print(f"  init {init}, {by_init['steps']} steps:")
                    for seed, r in by_init["seeds"].items():
                        print(f"    seed {seed:>5}: KD {r['kd']['student_val_perplexity']:.1f}, "
                              f"CE {r['ce']['student_val_perplexity']:.1f}: KD "
                              f"{r['kd_vs_ce_perplexity_reduction']:.1%} lower")  # fmt: skip
            if "kd_mixture" in sections:
                result = _spawn(
                    "kd_mixture",
                    common | {"base": str(base), "qa": "demo://chatterbot", "shards": str(shards),
                              "steps": args.student_steps},
                )  # fmt: skip
                report["kd_mixture"] = {"base": pretrained, **result, "machine": machine}
                lora_losses = result["teacher_lora"]
                print(f"Task-aware distillation, {result['steps']} steps per student; teacher = LoRA-tuned base "
                      f"(held-out answer loss {lora_losses['base_heldout_loss']:.3f} -> "
                      f"{lora_losses['tuned_heldout_loss']:.3f})")  # fmt: skip
                print(f"  {'seed':>5} {'arm':15} {'answer loss':>12} {'teacher':>8} {'corpus ppl':>11} {'teacher':>8}")
                for seed, by_arm in result["seeds"].items():
                    for arm, r in by_arm.items():
                        print(f"  {seed:>5} {arm:15} {r['student_heldout_answer_loss']:>12.3f} "
                              f"{r['teacher_heldout_answer_loss']:>8.3f} {r['student_val_perplexity']:>11.1f} "
                              f"{r['teacher_val_perplexity']:>8.1f}")  # fmt: skip
                for arm, mean in result["means"].items():
                    print(f"  mean  {arm:15} {mean['student_heldout_answer_loss']:>12.3f} "
                          f"{'':>8} {mean['student_val_perplexity']:>11.1f}")  # fmt: skip

    print(f"\nwrote {write_results('finetune_bench', report, path=args.json, machine=machine, merge=True)}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        import logging

        logging.disable(logging.INFO)
        os.environ.setdefault("TQDM_DISABLE", "1")
        print(json.dumps(CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))))
    else:
        main()
