"""Every stage's entry function behind one calling convention, for ``lmforge stage <name>``.

Each entry names the artifacts a stage reads and writes (the same names as its KFP component) and
calls the stage's ``run``; the component and the CLI therefore run the same code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any

from lmforge.errors import ConfigError
from lmforge.results import StageResult


@dataclass(frozen=True)
class StageSpec:
    """How to call one stage: its inputs/outputs/parameters and a function taking them by name."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: tuple[str, ...]
    call: Callable[..., StageResult]


def _module(name: str) -> Any:
    return import_module(f"lmforge.{name}")


def _evaluate(cfg: Any, **kw: str) -> StageResult:
    return _module("evaluate.evaluate").run(
        cfg,
        shards_dir=Path(kw["shards"]),
        models={k: Path(kw[k]) for k in ("teacher", "student")},
        onnx_models={k: Path(kw[k]) for k in ("onnx_fp32", "int8_dynamic", "int8_qdq") if kw.get(k)},
        engine_dir=Path(kw["engine"]) if kw.get("engine") else None,
        output_dir=Path(kw["evaluation"]),
        qa_uri=kw.get("qa_uri") or None,
        release_root=kw.get("release_root") or None,
        cleaned_dir=Path(kw["cleaned"]) if kw.get("cleaned") else None,
    )


def _promote(cfg: Any, **kw: str) -> StageResult:
    release = _module("release")
    names = ("student", "onnx_fp32", "int8_dynamic", "int8_qdq", "engine")
    return release.promote(
        cfg,
        release_root=kw["release_root"],
        version=kw.get("version") or release.default_version(),
        artifacts={name: Path(kw[name]) for name in names if kw.get(name)},
        evaluation_dir=Path(kw["evaluation"]),
    )


STAGE_SPECS: dict[str, StageSpec] = {
    "clean": StageSpec(
        ("corpus_uri",),
        ("cleaned",),
        (),
        lambda c, **k: _module("data.clean").run(c, **k),
    ),
    "tokenize": StageSpec(
        ("cleaned",),
        ("tokenizer", "shards"),
        (),
        lambda c, **k: _module("data.tokenize").run(c, **k),
    ),
    "pretrain": StageSpec(
        ("shards", "tokenizer"),
        ("model",),
        (),
        lambda c, **k: _module("train.pretrain").run(c, **k),
    ),
    "finetune_lora": StageSpec(
        ("base_model", "qa_uri"),
        ("adapter", "merged_model"),
        (),
        lambda c, **k: _module("train.lora").run(c, **k),
    ),
    "distill": StageSpec(
        ("teacher", "shards"),
        ("student",),
        (),
        lambda c, **k: _module("train.distill").run(c, **k),
    ),
    "export_onnx": StageSpec(
        ("model",),
        ("onnx_model",),
        (),
        lambda c, **k: _module("export.onnx_export").run(c, **k),
    ),
    "quantize_int8": StageSpec(
        ("onnx_model", "shards"),
        ("int8_dynamic", "int8_qdq"),
        (),
        lambda c, **k: _module("export.quantize").run(c, **k),
    ),
    "build_tensorrt": StageSpec(
        ("int8_qdq",),
        ("engine",),
        (),
        lambda c, **k: _module("export.tensorrt").run(c, **k),
    ),
    "evaluate": StageSpec(
        ("shards", "teacher", "student", "onnx_fp32", "int8_dynamic", "int8_qdq", "engine", "cleaned", "qa_uri"),
        ("evaluation",),
        ("release_root",),
        _evaluate,
    ),
    "promote": StageSpec(
        ("student", "onnx_fp32", "int8_dynamic", "int8_qdq", "engine", "evaluation"),
        (),
        ("release_root", "version"),
        _promote,
    ),
}


def run_stage(name: str, cfg: Any, paths: dict[str, str]) -> StageResult:
    """Run stage ``name`` with ``paths`` holding every required input, output and parameter by name."""
    if name not in STAGE_SPECS:
        raise ConfigError(f"unknown stage {name!r}; stages: {', '.join(STAGE_SPECS)}")
    spec = STAGE_SPECS[name]
    optional = {"engine", "onnx_fp32", "int8_dynamic", "int8_qdq", "version", "cleaned", "qa_uri"}
    required = [n for n in (*spec.inputs, *spec.outputs, *spec.params) if n not in optional]
    if missing := [n for n in required if not paths.get(n)]:
        raise ConfigError(f"stage {name}: missing {', '.join(missing)} (pass --io NAME=PATH)")
    if unknown := sorted(set(paths) - {*spec.inputs, *spec.outputs, *spec.params}):
        raise ConfigError(f"stage {name}: unknown argument(s) {', '.join(unknown)}")
    return spec.call(cfg, **paths)
