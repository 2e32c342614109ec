"""No stage module imports another stage's module: stages meet only through their artifacts, read with
:mod:`lmforge.contracts` and the shared modules (storage, formats, models, metrics, ...)."""

from __future__ import annotations

import ast
from pathlib import Path

from lmforge.stages import STAGES

SRC = Path(__file__).resolve().parents[3] / "src"
# Modules of the stage packages that several stages read or write by design: the formats of the artifacts that
# pass between stages (raw corpus, token shards, tokenizer, Q&A pairs, the demo data) and the sentence splitter
# tokenize-free stages share. Everything else in a stage package belongs to its stage.
SHARED_IN_STAGE_PACKAGES = {
    "lmforge.data.cleaned",
    "lmforge.data.corpus",
    "lmforge.data.jsonl",
    "lmforge.data.shards",
    "lmforge.data.signatures",
    "lmforge.data.tokenizer",
    "lmforge.data.qa",
    "lmforge.data.chunking",
    "lmforge.data.demo",
    # clean's per-document rules applied to a sample: preflight predicts retention with the rules clean runs.
    "lmforge.data.retention",
}


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")


ENTRY_MODULES = {spec.entry.partition(":")[0] for spec in STAGES.values()}
STAGE_PACKAGES = {module.rsplit(".", 1)[0] for module in ENTRY_MODULES if module.count(".") >= 2}


def _stage_of(module: str) -> str | None:
    """What a module belongs to: a stage's entry module is its own unit; any other module of a stage package
    (lmforge.data, lmforge.train, ...) belongs to its package, whose stages may share it; a shared module to none."""
    if module in ENTRY_MODULES:
        return module
    if module in SHARED_IN_STAGE_PACKAGES:
        return None
    return next((p for p in STAGE_PACKAGES if module == p or module.startswith(p + ".")), None)


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lmforge"):
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.startswith("lmforge")]
    return found


def test_no_stage_module_imports_another_stages_module():
    crossings = []
    for path in sorted((SRC / "lmforge").rglob("*.py")):
        module = _module_name(path)
        mine = _stage_of(module)
        if mine is None:
            continue
        own_package = module.rsplit(".", 1)[0]
        for target, names in _imports(path):
            imported = [f"{target}.{n}" for n in names if f"{target}.{n}" in ENTRY_MODULES] or [target]
            for candidate in imported:
                theirs = _stage_of(candidate)
                if theirs is not None and theirs not in (mine, own_package):
                    crossings.append(f"{module} -> {candidate}")
    assert not crossings, "cross-stage imports (use lmforge.contracts or a shared module):\n" + "\n".join(crossings)


def test_no_module_imports_a_private_name_of_another_package():
    private = []
    for path in sorted((SRC / "lmforge").rglob("*.py")):
        module = _module_name(path)
        for target, names in _imports(path):
            same_package = target.rsplit(".", 1)[0] == module.rsplit(".", 1)[0]
            private += [
                f"{module} -> {target}.{n}"
                for n in names
                if n.startswith("_") and not n.endswith("__") and not same_package
            ]
    assert not private
