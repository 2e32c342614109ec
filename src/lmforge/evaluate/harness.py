"""Standard evaluations: lm-evaluation-harness tasks on the evaluated PyTorch models.

``evaluate.harness.tasks`` names tasks (lmforge's packaged ``lmforge_qa_mc`` and ``lmforge_cloze``, see
:mod:`lmforge.evaluate.harness_data`, or any task lm-evaluation-harness knows) and/or task YAML files. Every YAML,
packaged or given, is rewritten into a scratch folder with its ``dataset_kwargs.data_files`` resolved: a relative
path against the YAML's own folder, an ``s3://`` URI fetched through :mod:`lmforge.storage`. That folder is the
harness's ``include_path``; each model directory runs through ``lm_eval.simple_evaluate`` with the harness's own
Hugging Face model class (``hf``), exactly as ``lm_eval --model hf --model_args pretrained=DIR --include_path
FOLDER --tasks TASK`` does, except that items whose continuation is longer than the model's context, which the
harness cannot score, are left out for that model and counted (:mod:`lmforge.evaluate.harness_fit`).

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
from lmforge.evaluate.harness_fit import fitting_documents, set_num_fewshot, skip_reason

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


def load_model(path: Path, cfg: HarnessConfig) -> Any:
    """The harness's Hugging Face model class (``hf``) on one model directory, built as ``lm_eval --model hf
    --model_args pretrained=DIR,dtype=float32`` builds it."""
    from lm_eval.api.registry import get_model

    return get_model("hf").create_from_arg_obj(
        {"pretrained": str(path), "dtype": "float32"},
        {"batch_size": cfg.batch_size, "max_batch_size": None, "device": "cpu"},
    )


def evaluate_model(
    lm: Any, tasks: list[str], cfg: HarnessConfig, task_manager: Any, samples: dict[str, list[int]] | None = None
) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` of ``tasks`` on ``lm``: the first ``cfg.limit`` documents of each, or the
    documents ``samples`` names per task."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        num_fewshot=cfg.num_fewshot,
        limit=None if samples is not None else cfg.limit,
        samples=samples,
        bootstrap_iters=cfg.bootstrap_iters,
        log_samples=False,
        task_manager=task_manager,
        verbosity="WARNING",
    )


def _fit(lm: Any, leaves: Mapping[str, Mapping[str, Any]], cfg: HarnessConfig) -> dict[str, tuple[list[int], int]]:
    """``{task: (ids of the documents that fit lm's context, documents)}`` of every leaf task."""
    fits = {}
    for by_leaf in leaves.values():
        for leaf, task in by_leaf.items():
            set_num_fewshot(task, cfg.num_fewshot)
            fits[leaf] = fitting_documents(lm, task, cfg.limit)
    return fits


def _runnable(leaves: Mapping[str, Mapping[str, Any]], fits: Mapping[str, tuple[list[int], int]]) -> list[str]:
    """What to hand ``simple_evaluate``: each requested name whose leaf tasks all keep documents; of a group with
    some leaves left empty, its other leaves (the group's aggregate is then not computed); nothing for a name whose
    leaves are all empty (the harness would evaluate an empty selection as the whole task)."""
    names = []
    for name, by_leaf in leaves.items():
        kept = [leaf for leaf in by_leaf if fits[leaf][0]]
        if len(kept) == len(by_leaf):
            names.append(name)
        else:
            if kept:
                log.warning("%s: some of its tasks have no item that fits; the group's aggregate is left out", name)
            names.extend(kept)
    return names


def _skipped(
    name: str, leaves: Mapping[str, Mapping[str, Any]], fits: Mapping[str, tuple[list[int], int]], context: int
) -> dict[str, dict[str, int]]:
    """``{task: {"skipped", "documents", "context"}}`` of the requested tasks that lost items (a group's counts are
    its leaf tasks' sums), each logged."""
    skipped = {}
    for task, by_leaf in leaves.items():
        kept, total = sum(len(fits[leaf][0]) for leaf in by_leaf), sum(fits[leaf][1] for leaf in by_leaf)
        if kept < total:
            skipped[task] = {"skipped": total - kept, "documents": total, "context": context}
            log.warning("%s: %s", name, skip_note(skipped[task], task))
    return skipped


def skip_note(entry: Mapping[str, Any], task: str | None = None) -> str:
    """``"[<task>: ]N of M items skipped: continuation longer than the model's context of C tokens"``."""
    head = f"{task}: " if task else ""
    return f"{head}{entry['skipped']} of {entry['documents']} items skipped: {skip_reason(int(entry['context']))}"


def all_skipped(harness: Mapping[str, Any], model: str, task: str) -> str | None:
    """The skip note (:func:`skip_note`, without the task) of ``model`` on ``task`` when it skipped every item (the
    task is n/a for it), else ``None``."""
    entry = ((harness.get("skipped") or {}).get(model) or {}).get(task)
    return skip_note(entry) if entry and entry["skipped"] >= entry["documents"] else None


def _task_info(source: str, by_leaf: Mapping[str, Any]) -> dict[str, Any]:
    """What the report and the gate need of a requested task (a group: of its leaf tasks together)."""
    types = {task.get_config("output_type") for task in by_leaf.values()}
    only = next(iter(by_leaf.values())) if len(by_leaf) == 1 else None
    return {
        "source": source,
        "output_type": types.pop() if len(types) == 1 else None,
        "documents": None,
        "higher_is_better": {m: b for task in by_leaf.values() for m, b in (task.higher_is_better() or {}).items()},
        "chance": (only.get_config("metadata") or {}).get("chance") if only is not None else None,
    }


def run_harness(cfg: HarnessConfig, models: Mapping[str, Path], workdir: Path) -> dict[str, Any]:
    """Run ``cfg.tasks`` on every model of ``cfg.models`` that is in ``models``.

    Items whose continuation is longer than a model's context are left out for that model
    (:mod:`lmforge.evaluate.harness_fit`) and counted; a task with every item left out has no scores for it.

    Returns:
        ``{"status": "evaluated", "lm_eval_version", "tasks": {task: {"source", "output_type", "documents",
        "higher_is_better", "chance"}}, "scores": {model: {task: {metric: value}}}, "skipped": {model: {task:
        {"skipped", "documents", "context"}}}, "errors": {model: why}}`` (``documents``: items given to each model
        before any is skipped; a model the harness failed on has no scores, and a gate check on it fails as missing;
        ``status`` is ``failed`` when no model has any), or ``{"status": "skipped", "reason"}``.
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
    leaves = {name: manager.load(name)["tasks"] for name in names}
    sources = dict(zip(names, cfg.tasks, strict=True))
    tasks = {name: _task_info(sources[name], by_leaf) for name, by_leaf in leaves.items()}
    scores: dict[str, dict[str, dict[str, float]]] = {}
    skipped: dict[str, dict[str, dict[str, int]]] = {}
    errors: dict[str, str] = {}
    for name, path in chosen.items():
        try:
            lm = load_model(path, cfg)
            fits = _fit(lm, leaves, cfg)
            runnable = _runnable(leaves, fits)
            whole = all(len(kept) == total for kept, total in fits.values())
            samples = None if whole else {leaf: kept for leaf, (kept, _) in fits.items() if kept}
            out = evaluate_model(lm, runnable, cfg, manager, samples) if runnable else {"results": {}}
        except Exception as exc:  # lm-eval's own checks, a model it cannot load
            errors[name] = f"{type(exc).__name__}: {exc}".strip(": ")
            log.warning("%s: lm-evaluation-harness failed (%s); its harness scores are missing", name, errors[name])
            continue
        scores[name] = {task: _scores(out["results"].get(task) or {}) for task in tasks}
        if lost := _skipped(name, leaves, fits, int(lm.max_length)):
            skipped[name] = lost
        for task, by_leaf in leaves.items():
            tasks[task]["documents"] = sum(fits[leaf][1] for leaf in by_leaf)
            tasks[task]["higher_is_better"] |= (out.get("higher_is_better") or {}).get(task) or {}
        log.info(
            "%s: harness %s",
            name,
            "; ".join(f"{t} " + ", ".join(f"{m} {v:.4g}" for m, v in s.items()) for t, s in scores[name].items()),
        )
    status = {"status": "evaluated" if scores else "failed", "lm_eval_version": version("lm-eval")}
    return {**status, "tasks": tasks, "scores": scores, "skipped": skipped, "errors": errors}


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
    return lines + [f"harness {line}" for line in skip_lines(harness)]


def skip_lines(harness: Mapping[str, Any]) -> list[str]:
    """``"<model>: <task>: N of M items skipped: ..."`` for every model and task that left items out."""
    return [
        f"{model}: {skip_note(entry, task)}"
        for model, by_task in (harness.get("skipped") or {}).items()
        for task, entry in by_task.items()
    ]
