"""No stage module imports another stage's module: stages meet only through their artifacts, read with the format
modules and the core modules (storage, config, models, metrics, ...), and through the registry.

A stage module is a registry entry's module. Every other module of ``lmforge`` is a shared module; a stage may
import any of them, but no shared module it reaches may lead to another stage's module either, so the rule
needs no list of allowed modules.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Collection
from pathlib import Path

from lmforge.stages import STAGES

SRC = Path(__file__).resolve().parents[3] / "src"


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")


MODULES = {_module_name(path): path for path in (SRC / "lmforge").rglob("*.py")}
STAGE_MODULES = {spec.entry.partition(":")[0] for spec in STAGES.values()}


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lmforge"):
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.startswith("lmforge")]
    return found


def imported_modules(module: str) -> set[str]:
    """The ``lmforge`` modules ``module`` imports anywhere in its file (``from pkg import mod`` names ``pkg.mod``)."""
    found = set()
    for target, names in _imports(MODULES[module]):
        submodules = {f"{target}.{name}" for name in names} & MODULES.keys()
        found |= submodules or {target}
    return found & MODULES.keys()


def stage_imports(
    stage_module: str,
    imports: Callable[[str], set[str]] = imported_modules,
    stage_modules: Collection[str] = STAGE_MODULES,
) -> list[str]:
    """Every ``stage_module -> ... module -> other stage module`` by which ``stage_module`` reaches another stage's
    module, directly or through the shared modules it imports (each shared module followed once)."""
    crossings, seen = [], set()
    todo = [(stage_module, target) for target in sorted(imports(stage_module))]
    while todo:
        via, target = todo.pop()
        if target in stage_modules:
            if target != stage_module:
                path = [stage_module, target] if via == stage_module else [stage_module, "...", via, target]
                crossings.append(" -> ".join(path))
            continue
        if target not in seen:
            seen.add(target)
            todo += [(target, deeper) for deeper in sorted(imports(target))]
    return crossings


def test_no_stage_module_reaches_another_stages_module():
    crossings = [crossing for module in sorted(STAGE_MODULES) for crossing in stage_imports(module)]
    assert not crossings, "a stage imports another stage (read its artifact with a format module):\n" + "\n".join(
        crossings
    )


def test_the_walk_finds_a_sibling_stage_imported_directly_or_through_a_shared_module():
    graph = {"data.a": {"data.shared", "core"}, "data.shared": {"data.b"}, "data.c": {"data.b"}, "core": set()}
    stages = {"data.a", "data.b", "data.c"}
    assert stage_imports("data.a", graph.get, stages) == ["data.a -> ... -> data.shared -> data.b"]
    assert stage_imports("data.c", graph.get, stages) == ["data.c -> data.b"]


def test_from_a_package_import_a_module_counts_as_importing_that_module():
    assert {"lmforge.release.catalog", "lmforge.storage"} <= imported_modules("lmforge.preflight.preflight")


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
