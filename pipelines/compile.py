"""Generate every component from the stage registry and compile it and every pipeline to YAML (``lmforge compile``).

Each stage's component is made in memory from its registry entry (:func:`lmforge_kfp.components.build_component`)
and compiled to ``components/<stage>/component.yaml`` (for reuse with ``kfp.components.load_component_from_file``)
with a generated ``README.md`` beside it; pipelines go to ``pipelines/compiled/<name>.yaml``; every config field to
``docs/config.md``; the stage table of ``README.md`` (where ``root`` has one) is rewritten from the registry.
The images are named by the tag of :func:`lmforge_kfp.components.images.image_tag` (the release tag unless
``$LMFORGE_IMAGE_TAG`` says otherwise), so the committed files change only when their content does.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from typing import Any

from kfp import compiler

from lmforge.stages import STAGES, render_config_markdown
from lmforge_kfp.components import build_component
from lmforge_kfp.components.images import image_tag
from lmforge_kfp.pipelines.component_docs import render_component_readme, render_index, with_stage_table

REPO_ROOT = Path(__file__).resolve().parent.parent
PIPELINES: dict[str, str] = {"lmforge_pipeline": "lmforge_kfp.pipelines.lmforge_pipeline:lmforge_pipeline"}
CONFIG_DOCS = Path("docs") / "config.md"


def pipeline_function(name: str):
    """The ``@dsl.pipeline`` object registered as ``name``."""
    module, _, attr = PIPELINES[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def compile_all(root: Path = REPO_ROOT) -> list[Path]:
    """Generate all components (YAML, README) and compile the pipelines under ``root``.

    Returns:
        The files written.
    """
    image_tag()  # a bad $LMFORGE_IMAGE_TAG fails here, before anything is written
    written: list[Path] = []
    components = {stage: build_component(stage) for stage in STAGES}
    for stage, component in components.items():
        folder = root / "components" / stage
        folder.mkdir(parents=True, exist_ok=True)
        compiler.Compiler().compile(component, str(folder / "component.yaml"))
        (folder / "README.md").write_text(render_component_readme(stage, component), encoding="utf-8")
        written += [folder / "component.yaml", folder / "README.md"]
    (root / "components" / "README.md").write_text(render_index(components), encoding="utf-8")
    written.append(root / "components" / "README.md")
    (root / CONFIG_DOCS).parent.mkdir(parents=True, exist_ok=True)
    (root / CONFIG_DOCS).write_text(render_config_markdown(), encoding="utf-8")
    written.append(root / CONFIG_DOCS)
    if (readme := root / "README.md").is_file():
        readme.write_text(with_stage_table(readme.read_text(encoding="utf-8")), encoding="utf-8")
        written.append(readme)
    for name in PIPELINES:
        target = root / "pipelines" / "compiled" / f"{name}.yaml"
        target.parent.mkdir(parents=True, exist_ok=True)
        compiler.Compiler().compile(pipeline_function(name), str(target))
        target.write_text(stable_header(target.read_text(encoding="utf-8")), encoding="utf-8")
        written.append(target)
    return written


_HEADER_DEFAULT = re.compile(r"^(#\s+\w+: \w+ \[Default: )(.*)(\])$")


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def stable_header(text: str) -> str:
    """Sort the keys of dict defaults in KFP's comment header, whose order otherwise changes run to run."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if not line.startswith("#"):
            break
        if (match := _HEADER_DEFAULT.match(line)) and match.group(2)[:1] in "[{":
            lines[i] = f"{match.group(1)}{_sorted(ast.literal_eval(match.group(2)))!r}{match.group(3)}"
    return "\n".join(lines)
