"""The whole pipeline's config, made from the registry's stage sections, and help text for every field.

A preset file (``lmforge/presets/<name>.yaml``) holds a partial :data:`PipelineConfig`: one section per
stage config (the fan-out steps share ``clean``). :func:`resolve_config` merges a preset with dotted
overrides and validates it; :func:`resolve_stage_config` does the same for one stage. :func:`explain`
lists a section's fields with their types, defaults and descriptions: ``lmforge config --explain``,
``docs/config.md`` and each ``<section>_overrides`` parameter's help in the Kubeflow UI are made from it.
"""

from __future__ import annotations

import functools
import json
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field, create_model

from lmforge.config.base import StrictModel, deep_merge, parse_overrides, validate_config
from lmforge.config.presets import load_preset
from lmforge.errors import ConfigError, did_you_mean
from lmforge.stages.registry import STAGES, get_stage


def sections() -> dict[str, type[StrictModel]]:
    """Config section name → model, in registry order (the preset file's top-level keys)."""
    found: dict[str, type[StrictModel]] = {}
    for spec in STAGES.values():
        if spec.config is None or spec.section is None:
            continue
        if found.setdefault(spec.section, spec.config) is not spec.config:
            raise ConfigError(f"section {spec.section!r} is given two config models in the stage registry")
    return found


def pipeline_config_model() -> type[StrictModel]:
    """The model of a whole preset: one field per section, each defaulting to its model's defaults.

    The same class while the registry's sections stay the same (a registered stage with a new section makes
    a new one).
    """
    return _model_of_sections(tuple(sections().items()))


@functools.cache
def _model_of_sections(items: tuple[tuple[str, type[StrictModel]], ...]) -> type[StrictModel]:
    fields: dict[str, Any] = {
        name: (model, Field(default_factory=model, description=_first_line(model))) for name, model in items
    }
    return create_model("PipelineConfig", __base__=StrictModel, **fields)


def resolve_config(preset: str = "tiny-cpu", overrides: str | dict[str, Any] | None = None) -> StrictModel:
    """Preset merged with overrides (full-pipeline keys such as ``pretrain.train.lr``), validated."""
    data = deep_merge(load_preset(preset), parse_overrides(overrides))
    if unknown := sorted(set(data) - set(sections())):
        names = ", ".join(f"{key!r}{did_you_mean(key, sections())}" for key in unknown)
        raise ConfigError(f"unknown config section(s) {names}; sections: {', '.join(sections())}")
    return validate_config(pipeline_config_model(), data)


def resolve_stage_config(
    stage: str, preset: str = "tiny-cpu", overrides: str | dict[str, Any] | None = None
) -> StrictModel | None:
    """One stage's config: its preset section merged with stage-relative overrides; ``None`` for a stage without one.

    ``stage`` is a stage name (``clean_shard`` reads section ``clean``) or a section name.
    """
    model, section = _model_of(stage)
    if model is None:
        if parse_overrides(overrides):
            raise ConfigError(f"stage {stage}: takes no config, but overrides were given: {overrides}")
        return None
    data = deep_merge(load_preset(preset).get(section, {}), parse_overrides(overrides))
    return validate_config(model, data, prefix=section)


def _model_of(stage: str) -> tuple[type[StrictModel] | None, str]:
    if stage in sections():
        return sections()[stage], stage
    spec = get_stage(stage)
    return spec.config, spec.section or spec.name


@dataclass(frozen=True)
class FieldHelp:
    """One config field for people: dotted path, type, default and description."""

    path: str
    type: str
    default: str
    description: str


def explain(target: str) -> list[FieldHelp]:
    """Every field under ``target`` (``SECTION`` or ``SECTION.FIELD[.SUBFIELD]``), nested models flattened.

    Raises:
        ConfigError: no such section or field (the message names the nearest valid one).
    """
    section, _, rest = target.partition(".")
    if section not in sections():
        raise ConfigError(
            f"unknown config section {section!r}{did_you_mean(section, sections())}; sections: {', '.join(sections())}"
        )
    rows = list(_fields(sections()[section], section))
    if not rest:
        return rows
    chosen = [row for row in rows if row.path == target or row.path.startswith(target + ".")]
    if not chosen:
        paths = [row.path for row in rows]
        raise ConfigError(f"unknown config field {target!r}{did_you_mean(target, paths)}")
    return chosen


def _fields(model: type[BaseModel], prefix: str) -> typing.Iterator[FieldHelp]:
    for name, info in model.model_fields.items():
        path = f"{prefix}.{name}"
        nested = _nested_model(info.annotation)
        if nested is not None:
            yield from _fields(nested, path)
            continue
        default = info.get_default(call_default_factory=True)
        yield FieldHelp(path, _type_name(info.annotation), json.dumps(_plain(default)), info.description or "")


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a field that is a (possibly nullable) nested model, else ``None``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    return str(annotation)


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def overrides_help(section: str) -> str:
    """One line per field (``path: type = default``), for a ``<section>_overrides`` parameter's description."""
    return "; ".join(f"{row.path.partition('.')[2]}: {row.type} = {row.default}" for row in explain(section))


def render_config_markdown() -> str:
    """``docs/config.md``: every section's fields with type, default and description (``lmforge compile`` writes it)."""
    lines = [
        "# Configuration reference",
        "",
        "Every stage reads one section of the pipeline config: a preset (`lmforge presets`) merged with your",
        "overrides — `--set SECTION.FIELD=VALUE` on the command line, or the `<section>_overrides` JSON object",
        'parameter of the pipeline (dotted keys nest: `{"train.max_steps": 100}`). `lmforge config --explain',
        "SECTION[.FIELD]` prints the same table; `lmforge config --preset P` the resolved values.",
        "",
    ]
    for section, model in sections().items():
        users = [spec.name for spec in STAGES.values() if spec.section == section]
        lines += [f"## `{section}`", "", f"{_first_line(model)} Read by: {', '.join(f'`{u}`' for u in users)}.", ""]
        lines += ["| field | type | default | description |", "|---|---|---|---|"]
        for row in explain(section):
            cells = (
                f"`{row.path.partition('.')[2]}`",
                _cell(row.type),
                f"`{_cell(row.default)}`",
                _cell(row.description),
            )
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["_Generated by `lmforge compile` from the config models; do not edit._", ""]
    return "\n".join(lines)


def _first_line(model: type[BaseModel]) -> str:
    return (model.__doc__ or "").strip().split("\n")[0]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


# The model of a whole preset with the built-in stages (pipeline_config_model() includes registered ones too).
PipelineConfig = pipeline_config_model()
