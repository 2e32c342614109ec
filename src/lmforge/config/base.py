"""Strict pydantic base model, override parsing and validation helpers shared by every config model."""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, ValidationError

from lmforge.errors import ConfigError, did_you_mean

Precision = Literal["fp32", "bf16", "fp16"]
# Kubernetes name and quantity syntax, for the fields that end up in a manifest (launch, serve).
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"


class StrictModel(BaseModel):
    """Base for all configs: strict types, unknown keys rejected, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, validate_default=True)


T = TypeVar("T", bound=StrictModel)


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Merge ``override`` into a copy of ``base``; nested mappings merge, other values replace."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def parse_overrides(overrides: str | dict[str, Any] | None) -> dict[str, Any]:
    """Accept overrides as a mapping or a JSON object string; dotted keys nest (``"train.lr": 1e-3``)."""
    if overrides is None or overrides == "":
        return {}
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"overrides are not valid JSON: {exc.msg} at char {exc.pos}") from exc
    if not isinstance(overrides, dict):
        raise ConfigError(f"overrides must be a JSON object, got {type(overrides).__name__}")
    nested: dict[str, Any] = {}
    for key, value in overrides.items():
        parts = key.split(".")
        leaf: dict[str, Any] = {parts[-1]: value}
        for part in reversed(parts[:-1]):
            leaf = {part: leaf}
        nested = deep_merge(nested, leaf)
    return nested


def format_validation_error(exc: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> str:
    """One line per problem: ``field.path: message (got value)``; an unknown field names the nearest valid one.

    Args:
        exc: pydantic's error.
        prefix: dotted path of the validated model inside the whole config (``pretrain``).
        model: the validated model, for the suggestion (``did you mean 'max_steps'?``) on an unknown field.
    """
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        got = "" if err["type"] == "missing" else f" (got {err.get('input')!r:.60})"
        hint = ""
        if err["type"] == "extra_forbidden" and model is not None:
            hint = _nearest_field(model, err["loc"])
        lines.append(f"{loc or '<root>'}: {err['msg']}{got}{hint}")
    return "; ".join(lines)


def _nearest_field(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """`` (did you mean 'name'?)`` for the unknown last key of ``loc``, from the fields of the model holding it."""
    owner: Any = model
    for part in loc[:-1]:
        field = owner.model_fields.get(part) if isinstance(part, str) else None
        owner = (
            next((t for t in (field.annotation, *get_args(field.annotation)) if _is_model(t)), None) if field else None
        )
        if owner is None:
            return ""
    return did_you_mean(str(loc[-1]), owner.model_fields)


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def validate_config(model: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Validate ``data`` as ``model``; raise :class:`ConfigError` naming each bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid config: {format_validation_error(exc, prefix, model)}") from exc


# Words that mark a name as holding a credential: such an env var comes from a Secret, never as a value in a
# manifest (LaunchConfig.env), and such a key is redacted from what tracking logs (lmforge.tracking.redact).
CREDENTIAL_WORDS = ("SECRET", "PASSWORD", "TOKEN", "ACCESS_KEY", "PRIVATE_KEY", "CREDENTIAL")
