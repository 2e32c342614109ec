"""The presets shipped with the package (``lmforge/presets/*.yaml``), read as raw mappings.

A preset holds a partial pipeline config, one section per stage config; :mod:`lmforge.stages.configs`
validates it against the sections the stage registry declares.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml

from lmforge.errors import ConfigError, did_you_mean


def list_presets() -> list[str]:
    """Names of the presets shipped with the package."""
    folder = resources.files("lmforge") / "presets"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_preset(name: str) -> dict[str, Any]:
    """Return the raw (unvalidated) mapping of preset ``name``."""
    if name not in list_presets():
        raise ConfigError(
            f"unknown preset {name!r}{did_you_mean(name, list_presets())}; available: {', '.join(list_presets())}"
        )
    text = (resources.files("lmforge") / "presets" / f"{name}.yaml").read_text(encoding="utf-8")
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"preset {name!r}: top level must be a mapping")
    return data


def describe_preset(name: str) -> str:
    """What preset ``name`` is for: its file's first line, ``# <name>: <what it is for>``."""
    load_preset(name)  # an unknown name fails here, naming the presets
    first = (resources.files("lmforge") / "presets" / f"{name}.yaml").read_text(encoding="utf-8").split("\n")[0]
    return first.removeprefix("#").strip().removeprefix(f"{name}:").strip()
