"""Thin KFP components, one folder per stage (installed as ``lmforge_kfp.components``).

``components/<stage>/component.py`` declares the component's signature, which the tests check against
the stage's registry entry (:mod:`lmforge.stages.registry`), and runs the entry point through
:func:`lmforge_kfp.runtime.run_component`. The folders are not Python packages: :func:`load_component`
imports ``component.py`` by path, so adding a stage adds no package to declare anywhere.
"""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path
from typing import Any

COMPONENTS_DIR = Path(__file__).resolve().parent


def component_stages() -> list[str]:
    """Names of the stages that have a ``components/<stage>/component.py``, sorted."""
    return sorted(p.parent.name for p in COMPONENTS_DIR.glob("*/component.py"))


@cache
def load_component(stage: str) -> Any:
    """The ``@dsl.component`` of ``stage`` (``components/<stage>/component.py``, function named after the stage)."""
    path = COMPONENTS_DIR / stage / "component.py"
    if not path.is_file():
        raise FileNotFoundError(f"no component for stage {stage!r}: {path} does not exist")
    name = f"{__name__}.{stage}_component"
    module_spec = importlib.util.spec_from_file_location(name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # inspect.getsource (KFP reads the function's source) finds it by module name
    module_spec.loader.exec_module(module)
    return getattr(module, stage)
