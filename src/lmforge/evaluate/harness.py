"""Standard evaluations: lm-evaluation-harness tasks on the evaluated PyTorch models.

``evaluate.harness.tasks`` names tasks (lmforge's packaged ``lmforge_qa_mc`` and ``lmforge_cloze``, see
:mod:`lmforge.evaluate.harness_data`, or any task lm-evaluation-harness knows) and/or task YAML files. Every YAML,
packaged or given, is rewritten into a scratch folder with its ``dataset_kwargs.data_files`` resolved: a relative
path against the YAML's own folder, an ``s3://`` URI fetched through :mod:`lmforge.storage`. That folder is the
harness's ``include_path``; each model directory runs through ``lm_eval.simple_evaluate`` with the harness's own
Hugging Face model class (``hf``), exactly as ``lm_eval --model hf --model_args pretrained=DIR --include_path
FOLDER --tasks TASK`` does.

The served ONNX models are not run: the harness's ONNX backends drive onnxruntime-genai or optimum exports, not
lmforge's graph, and a loglikelihood adapter over :class:`~lmforge.onnx_runtime.OrtCausalLM` would score the same
logits the student's row already has (the ``evaluate`` perplexity of ONNX FP32 equals the student's).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from lmforge import storage
from lmforge.config.evaluate import HarnessConfig
from lmforge.errors import ConfigError, InputDataError
from lmforge.evaluate.harness_data import TASKS_DIR

log = logging.getLogger("lmforge.evaluate")

PACKAGED_TASKS: tuple[str, ...] = ("lmforge_qa_mc", "lmforge_cloze")
PREFIX = "harness."
"""Metric names in results, gate checks, KFP Metrics and MLflow: ``harness.<task>.<metric>``."""


def is_yaml(spec: str) -> bool:
    """True for a task given as a YAML file (local or ``s3://``) rather than by name."""
    return spec.lower().endswith((".yaml", ".yml"))


def _fetch(uri: str, workdir: Path) -> Path:
    return storage.localize(uri, workdir) if storage.is_s3(uri) else Path(uri)


def _resolve_data_files(files: Any, base: str, workdir: Path, where: str) -> Any:
    """``data_files`` (a path, a list, or a split → path(s) mapping) with every entry a local absolute path."""
    if isinstance(files, Mapping):
        return {split: _resolve_data_files(v, base, workdir, where) for split, v in files.items()}
    if isinstance(files, list):
        return [_resolve_data_files(v, base, workdir, where) for v in files]
    if not isinstance(files, str):
        raise ConfigError(f"{where}: dataset_kwargs.data_files entries must be paths, got {files!r}")
    uri = files if storage.is_s3(files) or Path(files).is_absolute() else storage.join(base, files)
    local = _fetch(uri, workdir / "data")
    if not local.is_file():
        raise InputDataError(f"{where}: data file {uri} not found")
    return str(local.resolve())


def prepare_task(uri: str, out_dir: Path) -> str:
    """Copy the task YAML at ``uri`` into ``out_dir`` with its data files resolved; return the task's name.

    Raises:
        ConfigError: the YAML is not a mapping with a ``task`` name, or uses ``!function`` (Python next to the
            YAML, which a fetched copy cannot carry).
        InputDataError: a data file is missing.
    """
    source = _fetch(uri, out_dir / "fetched")
    if not source.is_file():
        raise InputDataError(f"harness task {uri}: file not found")
    try:
        config = yaml.safe_load(source.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"harness task {uri}: not a plain YAML task file ({exc}); !function is not supported"
        ) from exc
    if not isinstance(config, dict) or not isinstance(config.get("task"), str):
        raise ConfigError(f"harness task {uri}: expected a mapping with a 'task' name")
    kwargs = config.get("dataset_kwargs") or {}
    if "data_files" in kwargs:
        base = uri.rsplit("/", 1)[0] if storage.is_s3(uri) else str(source.resolve().parent)
        kwargs["data_files"] = _resolve_data_files(kwargs["data_files"], base, out_dir, uri)
        config["dataset_kwargs"] = kwargs
    (out_dir / f"{config['task']}.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return config["task"]


def prepare_tasks(specs: list[str], out_dir: Path) -> tuple[list[str], bool]:
    """Task names for ``simple_evaluate`` and whether any needs the harness's own task registry; the YAML tasks
    (packaged ones included) are written to ``out_dir``, the ``include_path``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names, registry = [], False
    for spec in specs:
        if spec in PACKAGED_TASKS:
            names.append(prepare_task(str(TASKS_DIR / f"{spec}.yaml"), out_dir))
        elif is_yaml(spec):
            names.append(prepare_task(spec, out_dir))
        else:
            names.append(spec)
            registry = True
    return names, registry


def _scores(task_results: Mapping[str, Any]) -> dict[str, float]:
    """``{"acc": .., "acc_stderr": ..}`` from the harness's ``{"acc,none": .., "acc_stderr,none": ..}``."""
    scores = {}
    for key, value in task_results.items():
        metric, _, filt = key.partition(",")
        if filt and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            scores[metric if filt == "none" else f"{metric}_{filt}"] = float(value)
    return scores


def evaluate_model(path: Path, tasks: list[str], cfg: HarnessConfig, task_manager: Any) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` on one Hugging Face model directory (the harness's ``hf`` model class)."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(path), "dtype": "float32"},
        tasks=tasks,
        num_fewshot=cfg.num_fewshot,
        batch_size=cfg.batch_size,
        device="cpu",
        limit=cfg.limit,
        bootstrap_iters=cfg.bootstrap_iters,
        log_samples=False,
        task_manager=task_manager,
        verbosity="WARNING",
    )


def run_harness(cfg: HarnessConfig, models: Mapping[str, Path], workdir: Path) -> dict[str, Any]:
    """Run ``cfg.tasks`` on every model of ``cfg.models`` that is in ``models``.

    Returns:
        ``{"status": "evaluated", "lm_eval_version", "tasks": {task: {"source", "output_type", "documents",
        "higher_is_better", "chance"}}, "scores": {model: {task: {metric: value}}}, "errors": {model: why}}``
        (a model the harness failed on has no scores, and a gate check on it fails as missing; ``status`` is
        ``failed`` when no model has any), or ``{"status": "skipped", "reason"}``.
    """
    chosen = {name: path for name, path in models.items() if name in cfg.models}
    if not cfg.enabled or not cfg.tasks:
        return {"status": "skipped", "reason": "disabled in config"}
    if not chosen:
        return {"status": "skipped", "reason": f"none of {cfg.models} was given as a PyTorch model"}
    try:
        from importlib.metadata import version

        import lm_eval  # noqa: F401
        from lm_eval.tasks import TaskManager
    except ImportError:
        log.warning("lm-eval is not installed (pip install 'lmforge[harness]'); harness tasks skipped")
        return {"status": "skipped", "reason": "lm-eval not installed (pip install 'lmforge[harness]')"}
    include = workdir / "harness-tasks"
    names, registry = prepare_tasks(cfg.tasks, include)
    manager = TaskManager(verbosity="WARNING", include_path=str(include), include_defaults=registry)
    sources = dict(zip(names, cfg.tasks, strict=True))
    tasks: dict[str, Any] = {}
    scores: dict[str, dict[str, dict[str, float]]] = {}
    errors: dict[str, str] = {}
    for name, path in chosen.items():
        try:
            out = evaluate_model(path, names, cfg, manager)
        except Exception as exc:  # lm-eval's own checks (a request longer than the model's context, say)
            errors[name] = f"{type(exc).__name__}: {exc}".strip(": ")
            log.warning("%s: lm-evaluation-harness failed (%s); its harness scores are missing", name, errors[name])
            continue
        scores[name] = {task: _scores(out["results"].get(task) or {}) for task in names}
        for task in names:
            config = out["configs"].get(task) or {}
            tasks[task] = {
                "source": sources[task],
                "output_type": config.get("output_type"),
                "documents": (out.get("n-samples") or {}).get(task, {}).get("effective"),
                "higher_is_better": (out.get("higher_is_better") or {}).get(task) or {},
                "chance": (config.get("metadata") or {}).get("chance"),
            }
        log.info(
            "%s: harness %s",
            name,
            "; ".join(f"{t} " + ", ".join(f"{m} {v:.4g}" for m, v in s.items()) for t, s in scores[name].items()),
        )
    status = {"status": "evaluated" if scores else "failed", "lm_eval_version": version("lm-eval")}
    return {**status, "tasks": tasks, "scores": scores, "errors": errors}


def flat_metrics(harness: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """``{model: {"harness.<task>.<metric>": value}}`` (standard errors left out)."""
    return {
        model: {
            f"{PREFIX}{task}.{metric}": value
            for task, metrics in by_task.items()
            for metric, value in metrics.items()
            if not metric.endswith("_stderr")
        }
        for model, by_task in (harness.get("scores") or {}).items()
    }


def summary_lines(harness: Mapping[str, Any]) -> list[str]:
    """One line per task and metric for a log or the run's last lines: ``<task> <metric>: base 0.27, ...``."""
    scores = harness.get("scores") or {}
    lines = []
    for task, info in (harness.get("tasks") or {}).items():
        metrics = dict.fromkeys(m for s in scores.values() for m in (s.get(task) or {}) if not m.endswith("_stderr"))
        chance = f" (chance {info['chance']:.2g})" if isinstance(info.get("chance"), int | float) else ""
        for metric in metrics:
            values = ", ".join(
                f"{model} {value:.4g}"
                for model, by_task in scores.items()
                if isinstance(value := (by_task.get(task) or {}).get(metric), int | float)
            )
            lines.append(f"harness {task} {metric}: {values}{chance if metric == 'acc' else ''}")
    return lines
