"""Thin KFP components, one folder per stage (installed as ``lmforge_kfp.components``).

A stage's component is made in memory from its registry entry: :func:`build_component` runs the source
:func:`lmforge_kfp.components.source.component_source` writes, whose signature is the stage's ports and whose
body runs the entry point through :func:`lmforge_kfp.runtime.run_component`. No ``component.py`` is written or
read, so adding a stage adds no file to keep in step with the registry. ``lmforge compile`` writes each
folder's ``component.yaml`` and ``README.md`` from the component.
"""

from __future__ import annotations

import linecache
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from lmforge.stages import get_stage
from lmforge_kfp.components.source import component_source

if TYPE_CHECKING:  # kfp is imported by the component's own source, not by importing this package
    from kfp.dsl.python_component import PythonComponent

COMPONENTS_DIR = Path(__file__).resolve().parent  # the stages' folders: compiled component.yaml and README


def build_component(stage: str) -> PythonComponent:
    """A new ``@dsl.component`` of ``stage``, made from its registry entry (its image named as the environment says).

    The source runs under a pseudo file name registered in :mod:`linecache`, so ``inspect.getsource`` (by which
    KFP embeds the function in the compiled YAML) returns exactly the generated text.
    """
    source = component_source(get_stage(stage))
    filename = f"<lmforge_kfp.components.{stage}>"
    # mtime None: linecache.checkcache keeps the entry, as it does for sources a module loader supplied.
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace = {"__name__": f"{__name__}.{stage}"}
    # dont_inherit: this module's `from __future__ import annotations` would turn KFP's annotations into strings.
    exec(compile(source, filename, "exec", dont_inherit=True), namespace)
    return namespace[stage]


@cache
def load_component(stage: str) -> PythonComponent:
    """The ``@dsl.component`` of ``stage``, built once per process (:func:`build_component`)."""
    return build_component(stage)
