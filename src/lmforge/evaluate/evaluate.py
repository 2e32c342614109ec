"""The ``evaluate`` stage: score every model on held-out tokens and Q&A, time it, gate it, report it.

Every model (PyTorch base, teacher and student, ONNX FP32 / INT8 dynamic / INT8 Q/DQ) is scored with the
same perplexity and latency code through a logits adapter, on the same held-out tokens with the same
window (the configured context and stride, clamped to the smallest model's maximum positions so the
numbers stay comparable); the documents' EOS separator is the prefix, so every held-out token is
scored, and bits per byte come from the tokenizer found in a model directory. Every model is also scored
on the reference answers of the held-out Q&A examples (:mod:`lmforge.evaluate.answer_loss`), and PyTorch
models answer the held-out prompts (:mod:`lmforge.evaluate.generation`). The gate
(:mod:`lmforge.evaluate.gate`) compares the result with fixed thresholds, with the teacher and the base
model (the task kept, the corpus not forgotten), with the data the cleaning kept, and with the production
release read from the registry. lm-evaluation-harness tasks run on the PyTorch models
(:mod:`lmforge.evaluate.harness`), and the verdict (:mod:`lmforge.evaluate.verdict`) says in one sentence per model
what it is good for. The TensorRT engine is not run here; its ``status.json`` (built, or
skipped with a reason) is reported as is.
"""

from __future__ import annotations

import gc
import json
import logging
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.artifacts import MANIFEST, input_record, read_json_file, read_manifest, staged_output, write_manifest
from lmforge.config import EvaluateConfig, TokenizeConfig
from lmforge.contracts import (
    QA_HELDOUT_FRACTION,
    REPORT_HTML,
    REPORT_MD,
    RESULTS_FILE,
    gate_result,
    max_positions,
    read_engine_status,
    read_history,
    scale_text,
    served_model,
)
from lmforge.data.qa import Example, qa_lineage
from lmforge.errors import ConfigError, InputDataError
from lmforge.evaluate.answer_loss import answer_loss, encode_heldout
from lmforge.evaluate.gate import GateDecision, check_gate, check_mark, headline
from lmforge.evaluate.generation import evaluate_generation, group_by_prompt, prompt_and_reference, samples
from lmforge.evaluate.harness import PREFIX as HARNESS_PREFIX
from lmforge.evaluate.harness import flat_metrics, run_harness
from lmforge.evaluate.plan_actual import plan_against_actual
from lmforge.evaluate.report import comparison_rows, html_report, markdown_summary
from lmforge.evaluate.verdict import verdict_lines
from lmforge.formats.token_shards import INDEX, TokenShards
from lmforge.metrics.latency import latency_profile
from lmforge.metrics.perplexity import (
    LogitsFn,
    onnx_logits_fn,
    perplexity,
    scored_bytes,
    scored_ids,
    torch_logits_fn,
)
from lmforge.release.catalog import production_baseline
from lmforge.results import StageResult

log = logging.getLogger("lmforge.evaluate")

LATENCY_WARMUP = 3
_MB = 1e6


def _model_config(path: Path) -> dict[str, Any]:
    config = path / "config.json"
    if not config.is_file():
        raise InputDataError(f"model directory {path}: no config.json")
    return read_json_file(config)


def _check_vocab(name: str, config: Mapping[str, Any], tokens: np.ndarray) -> None:
    vocab = config.get("vocab_size")
    top = int(tokens.max())
    if isinstance(vocab, int) and top >= vocab:
        raise InputDataError(
            f"model {name!r} has vocab_size {vocab} but the held-out tokens contain id {top}; "
            "it was trained with a different tokenizer than the token shards"
        )


def _score(name: str, logits_fn: LogitsFn, size_bytes: int, text: HeldOutText, cfg: EvaluateConfig) -> dict[str, Any]:
    ppl = perplexity(
        logits_fn,
        text.tokens,
        context=text.context,
        stride=text.stride,
        prefix=text.prefix,
        byte_count=text.bytes,
    )
    latency = latency_profile(
        logits_fn, text.tokens, context=text.context, runs=cfg.latency_runs, warmup=LATENCY_WARMUP
    )
    b1 = latency[1]
    log.info(
        "%s: perplexity %.4g over %d tokens, %.2f MB, p50 %.2f ms, p99 %.2f ms (batch 1)",
        name,
        ppl.perplexity,
        ppl.tokens,
        size_bytes / _MB,
        b1.p50_ms,
        b1.p99_ms,
    )
    return {
        **ppl.to_dict(),
        "size_bytes": int(size_bytes),
        "size_mb": size_bytes / _MB,
        "p50_ms": b1.p50_ms,
        "p90_ms": b1.p90_ms,
        "p99_ms": b1.p99_ms,
        "tokens_per_s": b1.tokens_per_s,
        "latency": {str(b): r.to_dict() for b, r in latency.items()},
    }


@dataclass(frozen=True)
class HeldOutText:
    """The held-out tokens and how every model scores them."""

    tokens: np.ndarray
    context: int
    stride: int
    prefix: int | None
    bytes: int | None


@dataclass(frozen=True)
class QASet:
    """Held-out Q&A prompts, each with all its reference answers, and where they came from."""

    groups: list[tuple[str, list[str]]]
    uri: str
    heldout_fraction: float
    fraction_source: str
    examples: list[Example]
    chat_template: str


AnswerRows = list[tuple[list[int], list[int]]]
"""Encoded held-out examples (:func:`lmforge.evaluate.answer_loss.encode_heldout`), scored for the answer loss."""


def _answer_loss(name: str, logits_fn: LogitsFn, rows: AnswerRows, pad_id: int) -> dict[str, Any]:
    if not rows:
        return {}
    loss = answer_loss(logits_fn, rows, pad_id=pad_id)
    log.info(
        "%s: held-out answer loss %.4f over %d answer tokens of %d examples",
        name,
        loss.mean,
        loss.tokens,
        loss.examples,
    )
    return {"answer_loss": loss.mean, "answer_loss_tokens": loss.tokens}


def _generate(
    name: str, model: Any, tokenizer: Any, qa: QASet, cfg: EvaluateConfig, positions: int | None = None
) -> tuple[dict[str, Any], list[str]]:
    """Greedy answers of one model (PyTorch, or an ONNX KV-cache decoder) to the held-out prompts, scored."""
    gen = cfg.generation
    scores, answers = evaluate_generation(
        model,
        tokenizer,
        qa.groups,
        max_new_tokens=gen.max_new_tokens,
        batch_size=gen.batch_size,
        stop_at_newline=gen.stop_at_newline,
        bleu_tokenize=gen.bleu_tokenize,
        seed=gen.seed,
        max_positions=positions,
    )
    em, f1, bleu, rouge = (scale_text(key) for key in ("exact_match", "f1", "bleu", "rouge_l"))
    log.info(
        "%s: EM %.3f (%s), F1 %.3f (%s), BLEU %.2f (%s), ROUGE-L %.3f (%s) on %d held-out prompts",
        name,
        scores.exact_match,
        em,
        scores.f1,
        f1,
        scores.bleu,
        bleu,
        scores.rouge_l,
        rouge,
        scores.prompts,
    )
    figures = {
        "exact_match": scores.exact_match,
        "f1": scores.f1,
        "bleu": scores.bleu,
        "rouge_l": scores.rouge_l,
        "empty_answer_fraction": scores.empty_predictions / scores.prompts,
        "generation": asdict(scores),
    }
    return figures, answers


def _generate_served(
    name: str, path: Path, qa: QASet, cfg: EvaluateConfig, positions: int | None
) -> tuple[dict[str, Any], list[str]] | None:
    """The served ONNX model's answers through its KV-cache decoder, as ``lmforge serve`` decodes; ``None`` when
    the directory has no such decoder (a TensorRT engine, or an export without one)."""
    from lmforge.model.base import base_tokenizer
    from lmforge.onnx_runtime import WITH_PAST_FILE, OrtDecoderWithPast

    if not (path / WITH_PAST_FILE).is_file():
        log.info("%s has no %s; the student's answers stand for it", name, WITH_PAST_FILE)
        return None
    decoder = OrtDecoderWithPast(path)
    try:
        return _generate(name, decoder, base_tokenizer(path), qa, cfg, positions)
    finally:
        del decoder
        gc.collect()


def _evaluate_torch(
    name: str, path: Path, text: HeldOutText, cfg: EvaluateConfig, qa: QASet | None, rows: AnswerRows, pad_id: int
) -> tuple[dict[str, Any], list[str] | None]:
    from lmforge.model.base import base_tokenizer
    from lmforge.model.build import load_causal_lm

    model = load_causal_lm(path)
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    answers = None
    try:
        fn = torch_logits_fn(model)
        result = {"format": "pytorch", **_score(name, fn, size, text, cfg), **_answer_loss(name, fn, rows, pad_id)}
        if qa is not None and name in cfg.generation.models:
            scores, answers = _generate(name, model, base_tokenizer(path), qa, cfg)
            result.update(scores)
    finally:
        del model
        gc.collect()
    return result, answers


def _evaluate_onnx(
    name: str, path: Path, text: HeldOutText, cfg: EvaluateConfig, rows: AnswerRows, pad_id: int
) -> dict:
    from lmforge.onnx_runtime import OrtCausalLM

    accuracy_gate = gate_result(path)
    model = OrtCausalLM(path)
    try:
        fn = onnx_logits_fn(model)
        result = {**_score(name, fn, model.size_bytes, text, cfg), **_answer_loss(name, fn, rows, pad_id)}
    finally:
        del model
        gc.collect()
    return {"format": "onnx", "accepted": accuracy_gate["accepted"], "gate_reason": accuracy_gate["reason"], **result}


def _find_tokenizer(paths: Mapping[str, Path]) -> Any | None:
    """The HF tokenizer of the first model directory holding one (all models share the shards' vocabulary)."""
    from lmforge.model.base import base_tokenizer

    for path in paths.values():
        if (path / "tokenizer.json").is_file():
            return base_tokenizer(path)
    return None


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    data = read_json_file(path)
    return data if isinstance(data, dict) else None


def load_qa_set(
    cfg: EvaluateConfig, models: Mapping[str, Path], qa_uri: str | None, tokenizer: Any | None
) -> QASet | None:
    """The held-out Q&A prompts: the split LoRA made (its recorded fraction) unless the config overrides it."""
    from lmforge.data.qa import load_examples, split_examples

    lineage = qa_lineage(models.values())
    recorded_fraction, chat_template = lineage.heldout_fraction, lineage.chat_template
    uri = qa_uri or lineage.uri
    if uri is None:
        log.warning("no Q&A data given and none recorded in the models' manifests; generation metrics skipped")
        return None
    if cfg.generation.heldout_fraction is not None:
        fraction, source = cfg.generation.heldout_fraction, "evaluate.generation.heldout_fraction"
    elif recorded_fraction is not None:
        fraction, source = recorded_fraction, "the LoRA stage's manifest"
    else:
        fraction, source = QA_HELDOUT_FRACTION, "the finetune_lora default"
    if tokenizer is None:
        log.warning("no tokenizer.json in any model directory; generation metrics skipped")
        return None
    _, heldout = split_examples(load_examples(str(uri)), fraction)
    asked = [prompt_and_reference(example, tokenizer, chat_template) for example in heldout]
    groups = group_by_prompt(asked, cfg.generation.max_prompts)
    prompts = {prompt for prompt, _ in groups}
    scored = [example for example, (prompt, _) in zip(heldout, asked, strict=True) if prompt in prompts]
    log.info("Q&A: %d held-out prompts from %s (heldout_fraction %g from %s)", len(groups), uri, fraction, source)
    return QASet(
        groups=groups,
        uri=str(uri),
        heldout_fraction=fraction,
        fraction_source=source,
        examples=scored,
        chat_template=chat_template,
    )


def _confidence_entry(counts: Mapping[str, int], minimums: Mapping[str, int]) -> dict[str, Any]:
    """Held-out counts against their minimums, and the "low confidence: ..." note when one falls short."""
    low = any(counts[k] < minimums[k] for k in counts)
    shown = " / ".join(f"{n:,} {k}" for k, n in counts.items())
    floor = " / ".join(f"{n:,}" for n in minimums.values())
    note = f"low confidence: {shown} (minimum {floor})" if low else None
    return {**counts, "minimum": dict(minimums), "low": low, "note": note}


def held_out_confidence(
    shards_dir: Path, scored_tokens: int, qa: QASet | None, cfg: EvaluateConfig
) -> dict[str, dict[str, Any]]:
    """Whether the held-out text (tokens scored, val documents) and Q&A prompts reach their minimums: the split's
    ``tokenize.min_val_tokens`` / ``min_val_documents`` (as its manifest records them) and
    ``evaluate.generation.min_prompts``."""
    recorded = (_read_json(shards_dir / MANIFEST) or {}).get("config") or {}
    minimums = {
        "tokens": int(recorded.get("min_val_tokens", TokenizeConfig().min_val_tokens)),
        "documents": int(recorded.get("min_val_documents", TokenizeConfig().min_val_documents)),
    }
    index = _read_json(shards_dir / INDEX) or {}
    val_documents = int(((index.get("splits") or {}).get("val") or {}).get("documents", 0))
    out = {"text": _confidence_entry({"tokens": scored_tokens, "documents": val_documents}, minimums)}
    if qa is not None:
        out["qa"] = _confidence_entry({"prompts": len(qa.groups)}, {"prompts": cfg.generation.min_prompts})
    for what, entry in out.items():
        if entry["low"]:
            log.warning("held-out %s: %s", what, entry["note"])
    return out


def data_summary(shards_dir: Path, cleaned_dir: Path | None) -> dict[str, Any]:
    """Token counts per split (``index.json``) and, given a cleaned corpus, its ``stats.json`` figures."""
    summary: dict[str, Any] = {}
    index = _read_json(shards_dir / INDEX) or {}
    if isinstance(index.get("splits"), dict):
        summary["tokens"] = {"vocab_size": index.get("vocab_size"), "splits": index["splits"]}
    if cleaned_dir is not None:
        stats = _read_json(Path(cleaned_dir) / "stats.json")
        if stats is None:
            raise InputDataError(f"cleaned corpus {cleaned_dir}: no stats.json")
        summary["clean"] = {
            "input": stats.get("input"),
            "metrics": stats.get("metrics") or {},
            "removed": stats.get("removed") or {},
        }
    return summary


def _engine_entry(status: Mapping[str, Any]) -> dict[str, Any] | None:
    """The engine's row in ``models`` when it was built: its size and any figures its stage measured."""
    if status.get("status") != "built":
        return None
    entry: dict[str, Any] = {"format": "tensorrt"}
    if isinstance(status.get("size_bytes"), int):
        entry["size_bytes"] = status["size_bytes"]
        entry["size_mb"] = status["size_bytes"] / _MB
    for key in ("perplexity", "bits_per_token", "p50_ms", "p99_ms", "tokens_per_s"):
        if isinstance(status.get(key), int | float):
            entry[key] = float(status[key])
    return entry


MODEL_METRICS: tuple[str, ...] = (
    "perplexity",
    "bits_per_token",
    "bits_per_byte",
    "size_mb",
    "p50_ms",
    "p99_ms",
    "tokens_per_s",
    "exact_match",
    "f1",
    "bleu",
    "rouge_l",
    "answer_loss",
    "empty_answer_fraction",
)
"""Per-model figures logged as ``<model>_<metric>`` KFP metrics (and kept in the release manifest), with every
harness metric as ``<model>_harness.<task>.<metric>``."""


def run(
    cfg: EvaluateConfig,
    *,
    shards: str | Path,
    evaluation: str | Path,
    teacher: str | Path | None = None,
    student: str | Path | None = None,
    onnx_fp32: str | Path | None = None,
    int8_dynamic: str | Path | None = None,
    int8_qdq: str | Path | None = None,
    engine: str | Path | None = None,
    cleaned: str | Path | None = None,
    qa_uri: str | None = None,
    release_root: str | None = None,
    model_name: str | None = None,
    run_id: str = "",
    preset: str = "",
    base: str | Path | None = None,
    plan: str = "",
) -> StageResult:
    """The ``evaluate`` stage: :func:`evaluate_models` on the pipeline's models, by their artifact names.

    ``run_id`` and ``preset`` (the run's, from the stage's context) are named in the report. ``base`` is the
    pretrained model the teacher was tuned from (``pretrain``'s output), evaluated next to teacher and student.
    ``plan`` is preflight's training plan (JSON), set against the training histories in the report.

    Raises:
        ConfigError: ``release_root`` without ``model_name`` (the production release would be unknown).
    """
    if release_root and not model_name:
        raise ConfigError("evaluate: release_root is given but model_name is not; the gate's baseline is unknown")
    given = {"teacher": teacher, "student": student, "onnx_fp32": onnx_fp32, "int8_dynamic": int8_dynamic}
    given["int8_qdq"] = int8_qdq
    return evaluate_models(
        cfg,
        shards_dir=shards,
        models={name: path for name, path in given.items() if path and name in ("teacher", "student")},
        onnx_models={name: path for name, path in given.items() if path and name not in ("teacher", "student")},
        engine_dir=engine,
        output_dir=evaluation,
        qa_uri=qa_uri or None,
        release_root=release_root or None,
        model_name=model_name,
        cleaned_dir=cleaned,
        run_id=run_id,
        preset=preset,
        base=base,
        plan=_parse_plan(plan),
    )


def _parse_plan(plan: str) -> dict[str, Any] | None:
    """Preflight's training plan from its JSON (``None`` when empty)."""
    if not plan:
        return None
    try:
        parsed = json.loads(plan)
    except json.JSONDecodeError as exc:
        raise InputDataError(f"evaluate: plan is not valid JSON ({exc.msg}); pass preflight's plan output") from exc
    if not isinstance(parsed, dict):
        raise InputDataError("evaluate: plan must be a JSON object (preflight's plan output)")
    return parsed


def evaluate_models(
    cfg: EvaluateConfig,
    *,
    shards_dir: str | Path,
    models: Mapping[str, str | Path],
    onnx_models: Mapping[str, str | Path],
    engine_dir: str | Path | None,
    output_dir: str | Path,
    qa_uri: str | None = None,
    release_root: str | None = None,
    model_name: str | None = None,
    cleaned_dir: str | Path | None = None,
    run_id: str = "",
    preset: str = "",
    base: str | Path | None = None,
    plan: Mapping[str, Any] | None = None,
) -> StageResult:
    """Evaluate every given model and write ``report.html``, ``report.md``, ``results.json``.

    Args:
        cfg: context, stride, token budget, latency runs, generation settings and the gate thresholds.
        shards_dir: token shards; the ``val`` split is the held-out text.
        models: Hugging Face model directories by name (``teacher``, ``student``).
        onnx_models: ONNX model directories by name (``onnx_fp32``, ``int8_dynamic``, ``int8_qdq``).
        engine_dir: the TensorRT stage's output (with ``status.json``), or ``None``.
        output_dir: where the evaluation artifact is committed (manifest kind ``evaluation``).
        qa_uri: Q&A JSONL for generation metrics; ``None`` takes the one recorded in the teacher's manifest.
        release_root: the model registry; its ``latest.json`` release is what the gate compares with (or, with
            ``cfg.production_source`` mlflow, the MLflow alias's release).
        model_name: release name in the registry whose production release is the gate's baseline.
        cleaned_dir: the ``clean`` stage's output, for the data summary in the report (``stats.json``) and the
            gate's data-retention check.
        run_id, preset: named in the report (with the config every model's manifest records).
        base: the pretrained (base) model the teacher was tuned from, evaluated as PyTorch model ``base`` so that the
            report shows base, teacher and student side by side and the gate can bound forgetting.
        plan: preflight's training plan; ``results["plan_vs_actual"]`` sets it against the training histories of
            base, teacher and student (:mod:`lmforge.evaluate.plan_actual`).
    """
    setup = _prepare(cfg, shards_dir, _with_base(models, onnx_models, base), onnx_models, engine_dir, qa_uri)
    evaluated, answers, harness, served = _score_models(cfg, setup, engine_dir)
    results: dict[str, Any] = {
        "context": setup.text.context,
        "stride": setup.text.stride,
        "prefix_token": setup.text.prefix,
        "eval_tokens": int(setup.text.tokens.size),
        "eval_bytes": setup.text.bytes,
        "latency_runs": cfg.latency_runs,
        "models": evaluated,
        "served_model": served,
        "tensorrt": setup.trt,
        "generation": _generation_summary(cfg, setup.qa, evaluated, answers),
        "harness": harness,
        "confidence": held_out_confidence(Path(shards_dir), int(setup.text.tokens.size), setup.qa, cfg),
        "production": production_baseline(release_root, model_name or "", cfg.production_source),
        "data": data_summary(Path(shards_dir), Path(cleaned_dir) if cleaned_dir is not None else None),
    }
    decision = _judge(cfg, results)
    histories = {name: h for name, path in setup.paths.items() if (h := read_history(path)) is not None}
    results["plan_vs_actual"] = plan_against_actual(plan, histories, _world_sizes(setup.paths))
    report, summary_md = _reports(results, setup.paths, histories, cfg, run_id, preset)
    metrics = _model_metrics(evaluated, decision.passed)
    inputs = _input_records(Path(shards_dir), setup, engine_dir, results)
    _write_evaluation(output_dir, cfg, results, {REPORT_HTML: report, REPORT_MD: summary_md}, inputs, metrics)
    return StageResult(
        metrics=metrics,
        html=report,
        summary={
            "passed": decision.passed,
            "checks": results["gate"]["checks"],
            "warnings": decision.warnings,
            "headline": results["headline"],
            "verdict": results["verdict"],
            "table": comparison_rows(results),
        },
        markdown=summary_md,
    )


@dataclass(frozen=True)
class _Setup:
    """What :func:`evaluate_models` evaluates, and on what."""

    torch_paths: dict[str, Path]
    paths: dict[str, Path]
    """Every model's directory: the PyTorch models', then the ONNX models'."""
    configs: dict[str, dict[str, Any]]
    trt: dict[str, Any]
    text: HeldOutText
    qa: QASet | None
    rows: AnswerRows
    pad_id: int

    def is_onnx(self, name: str) -> bool:
        """Whether ``name`` is one of the ONNX models."""
        return name in self.paths and name not in self.torch_paths


def _prepare(
    cfg: EvaluateConfig,
    shards_dir: str | Path,
    models: Mapping[str, str | Path],
    onnx_models: Mapping[str, str | Path],
    engine_dir: str | Path | None,
    qa_uri: str | None,
) -> _Setup:
    """Read the held-out tokens, the engine's status and every model's config (refusing a vocabulary the tokens
    exceed), and set the window, the held-out Q&A set and its encoded answers."""
    shards = TokenShards.open(shards_dir)
    tokens = np.asarray(shards.tokens("val")[: cfg.max_eval_tokens]).astype(np.int64)
    if tokens.size < 1:
        raise InputDataError(f"{shards_dir}: the val split has no tokens")
    trt = read_engine_status(Path(engine_dir) if engine_dir is not None else None)
    torch_paths = {name: Path(p) for name, p in models.items()}
    paths = {**torch_paths, **{name: Path(p) for name, p in onnx_models.items()}}
    configs = {name: _model_config(path) for name, path in paths.items()}
    for name, config in configs.items():
        _check_vocab(name, config, tokens)
    context, stride = _window(cfg, configs)
    tokenizer = _find_tokenizer(paths)
    text = _held_out_text(tokens, context, stride, shards.eos_id, tokenizer)
    qa = load_qa_set(cfg, torch_paths, qa_uri, tokenizer) if cfg.generation.enabled else None
    rows: AnswerRows = []
    if qa is not None and tokenizer is not None:
        rows = encode_heldout(tokenizer, qa.examples, context=context, chat_template=qa.chat_template)
    pad_id = tokenizer.pad_token_id if tokenizer is not None else 0
    return _Setup(torch_paths, paths, configs, trt, text, qa, rows, pad_id)


def _score_models(
    cfg: EvaluateConfig, setup: _Setup, engine_dir: str | Path | None
) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]], dict[str, Any], str | None]:
    """``(models, answers, harness, served model)``: every model's figures (the built engine's too) with its
    harness metrics, the answers to the held-out prompts by model (the served ONNX model's through its KV-cache
    decoder), the harness's results and the served model's name."""
    evaluated, answers = _evaluate_each(setup, cfg)
    if (engine := _engine_entry(setup.trt)) is not None:
        evaluated["tensorrt"] = {"uri": str(engine_dir), **engine}
    with tempfile.TemporaryDirectory(prefix="lmforge-harness-") as workdir:
        harness = run_harness(cfg.harness, setup.torch_paths, Path(workdir))
    for name, figures in flat_metrics(harness).items():
        evaluated[name].update(figures)
    served = served_model(evaluated)
    if setup.qa is not None and cfg.generation.served and setup.is_onnx(served):
        positions = max_positions(setup.configs[served])
        generated = _generate_served(served, setup.paths[served], setup.qa, cfg, positions)
        if generated is not None:
            evaluated[served].update(generated[0])
            answers[served] = generated[1]
    return evaluated, answers, harness, served


def _with_base(
    models: Mapping[str, str | Path], onnx_models: Mapping[str, str | Path], base: str | Path | None
) -> Mapping[str, str | Path]:
    """The PyTorch models with ``base`` first (when given); refuse a name given twice, or no model at all."""
    if base:
        if "base" in models:
            raise InputDataError("evaluate: a base model given both as base= and in models")
        models = {"base": base, **models}
    overlap = set(models) & set(onnx_models)
    if overlap:
        raise InputDataError(f"model names given both as PyTorch and ONNX models: {sorted(overlap)}")
    if not models and not onnx_models:
        raise InputDataError("evaluate: no models given")
    return models


def _window(cfg: EvaluateConfig, configs: Mapping[str, Mapping[str, Any]]) -> tuple[int, int]:
    """``(context, stride)`` every model is scored with: the configured ones, clamped to the smallest model's maximum
    positions (warned of)."""
    limits = [m for m in (max_positions(c) for c in configs.values()) if m is not None]
    context = min([cfg.context, *limits])
    if context < cfg.context:
        log.warning("context %d exceeds a model's maximum positions; using %d for all models", cfg.context, context)
    return context, min(cfg.stride or context, context)


def _held_out_text(tokens: np.ndarray, context: int, stride: int, prefix: int | None, tokenizer: Any) -> HeldOutText:
    """The held-out tokens, their window, and the bytes they stand for (given a tokenizer; else warned of)."""
    n_bytes = scored_bytes(tokenizer, scored_ids(tokens, prefix=prefix)) if tokenizer is not None else None
    if tokenizer is None:
        log.warning("no tokenizer.json in any model directory; bits per byte not computed")
    return HeldOutText(tokens=tokens, context=context, stride=stride, prefix=prefix, bytes=n_bytes)


def _evaluate_each(setup: _Setup, cfg: EvaluateConfig) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]:
    """``(entries, answers)``: every model's figures by name, and the answers of the PyTorch models that answered
    the held-out prompts."""
    evaluated: dict[str, dict[str, Any]] = {}
    answers: dict[str, list[str]] = {}
    for name, path in setup.paths.items():
        log.info("evaluating %s (%s)", name, path)
        if name in setup.torch_paths:
            entry, generated = _evaluate_torch(name, path, setup.text, cfg, setup.qa, setup.rows, setup.pad_id)
            if generated is not None:
                answers[name] = generated
        else:
            entry = _evaluate_onnx(name, path, setup.text, cfg, setup.rows, setup.pad_id)
        evaluated[name] = {"uri": str(path), **entry}
    return evaluated, answers


def _generation_summary(
    cfg: EvaluateConfig, qa: QASet | None, evaluated: Mapping[str, Mapping[str, Any]], answers: Mapping[str, list[str]]
) -> dict[str, Any]:
    """``results["generation"]``: skipped and why, or the held-out prompts' source, settings and sample answers."""
    if not cfg.generation.enabled:
        return {"status": "skipped", "reason": "disabled in config"}
    if qa is None:
        return {"status": "skipped", "reason": "no Q&A data given or recorded in the teacher's manifest"}
    signature = next((e["generation"]["bleu_signature"] for e in evaluated.values() if "generation" in e), None)
    return {
        "status": "evaluated" if answers else "skipped",
        "reason": None if answers else f"none of {cfg.generation.models} was given as a PyTorch model",
        "qa_uri": qa.uri,
        "heldout_fraction": qa.heldout_fraction,
        "heldout_fraction_source": qa.fraction_source,
        "prompts": len(qa.groups),
        "max_new_tokens": cfg.generation.max_new_tokens,
        "bleu_signature": signature,
        "samples": samples(qa.groups, answers, cfg.generation.samples),
    }


def _judge(cfg: EvaluateConfig, results: dict[str, Any]) -> GateDecision:
    """Gate ``results`` and add the decision, the headline and the verdict to them; log each; the decision."""
    decision = check_gate(cfg.gate, results)
    results["gate"] = decision.to_dict()
    results["passed"] = decision.passed
    results["headline"] = headline(results)
    results["verdict"] = verdict_lines(results)
    log.info("gate %s", "passed" if decision.passed else "failed")
    for check in decision.checks:
        log.info("  %s %s: %s", check_mark(asdict(check)), check.name, check.reason)
    for warning in decision.warnings:
        log.warning("gate warning: %s", warning)
    for line in results["verdict"]:
        log.info("verdict: %s", line)
    return decision


def _world_sizes(paths: Mapping[str, Path]) -> dict[str, int]:
    """The training processes each model's manifest records (``metrics.world_size``), where it does."""
    sizes = {name: read_manifest(path).get("metrics", {}).get("world_size") for name, path in paths.items()}
    return {name: int(size) for name, size in sizes.items() if isinstance(size, int | float) and size >= 1}


def _reports(
    results: Mapping[str, Any],
    paths: Mapping[str, Path],
    histories: Mapping[str, Mapping[str, Any]],
    cfg: EvaluateConfig,
    run_id: str,
    preset: str,
) -> tuple[str, str]:
    """``(report.html, report.md)``: the HTML report shows each model's training history and the config each was
    made with (as its manifest records it) and this stage's own."""
    configs = {name: read_manifest(path).get("config") for name, path in paths.items()}
    configs["evaluate"] = cfg.model_dump(mode="json")
    report = html_report(results, histories, run_id=run_id or None, preset=preset or None, config=configs)
    return report, markdown_summary(results, run_id=run_id or None, preset=preset or None)


def _model_metrics(evaluated: Mapping[str, Mapping[str, Any]], passed: bool) -> dict[str, float]:
    """``<model>_<metric>`` of every :data:`MODEL_METRICS` figure and harness metric a model has, and ``passed``."""
    metrics: dict[str, float] = {}
    for name, entry in evaluated.items():
        for key in [*MODEL_METRICS, *(k for k in entry if k.startswith(HARNESS_PREFIX))]:
            if isinstance(entry.get(key), int | float):
                metrics[f"{name}_{key}"] = float(entry[key])
    metrics["passed"] = 1.0 if passed else 0.0
    return metrics


def _input_records(
    shards_dir: Path, setup: _Setup, engine_dir: str | Path | None, results: Mapping[str, Any]
) -> dict[str, Any]:
    """The evaluation manifest's inputs: the shards and every model, the engine's status, the Q&A set and the
    production release compared with."""
    inputs = {"shards": input_record(shards_dir), **{name: input_record(path) for name, path in setup.paths.items()}}
    if engine_dir is not None:
        inputs["tensorrt"] = {"uri": str(engine_dir), "status": setup.trt["status"]}
    if (qa := setup.qa) is not None:
        inputs["qa"] = {"uri": qa.uri, "heldout_fraction": qa.heldout_fraction, "prompts": len(qa.groups)}
    if results["production"].get("status") == "found":
        inputs["production"] = {k: results["production"][k] for k in ("version", "manifest_uri", "fingerprint")}
    return inputs


def _write_evaluation(
    output_dir: str | Path,
    cfg: EvaluateConfig,
    results: Mapping[str, Any],
    reports: Mapping[str, str],
    inputs: dict[str, Any],
    metrics: dict[str, float],
) -> None:
    """Commit the evaluation artifact: the reports (file name to text), ``results.json`` and the manifest."""
    with staged_output(output_dir) as scratch:
        for name, text in reports.items():
            (scratch / name).write_text(text, encoding="utf-8")
        (scratch / RESULTS_FILE).write_text(json.dumps(results, indent=2), encoding="utf-8")
        write_manifest(
            scratch,
            "evaluation",
            inputs=inputs,
            config=cfg.model_dump(mode="json"),
            metrics=metrics,
            extra={"passed": results["passed"]},
        )
