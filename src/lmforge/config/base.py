"""Strict pydantic base model, override parsing and validation helpers shared by every config model."""

from __future__ import annotations

import json
import re
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

    The value is left out when a model's own check failed (the message names what is wrong) or sits under a key
    that may hold a credential: an error message must not carry a secret into logs.

    Args:
        exc: pydantic's error.
        prefix: dotted path of the validated model inside the whole config (``pretrain``).
        model: the validated model, for the suggestion (``did you mean 'max_steps'?``) on an unknown field.
    """
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        got = "" if _unquoted(err) else f" (got {err.get('input')!r:.60})"
        hint = ""
        if err["type"] == "extra_forbidden" and model is not None:
            hint = _nearest_field(model, err["loc"])
        lines.append(f"{loc or '<root>'}: {err['msg']}{got}{hint}")
    return "; ".join(lines)


def _unquoted(err: Any) -> bool:
    """True when an error's input must not be quoted (see :func:`format_validation_error`)."""
    if err["type"] == "missing" or (err["type"] == "value_error" and isinstance(err.get("input"), dict)):
        return True  # a model's own check: its input is the whole object
    return any(isinstance(part, str) and credential_fragment(part) for part in err["loc"])


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


# Whole words that mark a config key or env var as holding a credential: such a key is redacted from what
# tracking logs (lmforge.tracking.redact). LaunchConfig.env refuses more (credential_fragment).
CREDENTIAL_WORDS = (
    *("SECRET", "PASSWORD", "PASSWD", "TOKEN", "ACCESS_KEY", "PRIVATE_KEY", "CREDENTIAL"),
    *("API_KEY", "APIKEY", "AUTHORIZATION", "COOKIE", "SESSION_KEY"),
)
# Deny by default: an env var whose name contains any of these (anywhere, any case) may hold a credential and is
# refused as a plain value in a manifest; it comes from a Secret by reference (LaunchConfig.secret_env).
CREDENTIAL_FRAGMENTS = (
    *("KEY", "TOKEN", "SECRET", "PASS", "PWD", "CRED", "AUTH", "COOKIE", "SESSION", "PRIVATE", "SALT"),
    *("DSN", "CONNECTION_STRING", "CONNSTR"),
)
# Names that contain a fragment but are known settings, not credentials.
NOT_CREDENTIALS = frozenset({"TOKENIZERS_PARALLELISM", "HF_HUB_DISABLE_IMPLICIT_TOKEN"})
# The password of a URL: ``scheme://user:password@``.
URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*):(?P<password>[^/\s@]+)@")


def credential_fragment(name: str) -> str | None:
    """The fragment of :data:`CREDENTIAL_FRAGMENTS` that makes env var ``name`` a possible credential, if any."""
    if name.upper() in NOT_CREDENTIALS:
        return None
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).upper()  # apiKey -> API_KEY
    return next((f for f in CREDENTIAL_FRAGMENTS if f in words or f.replace("_", "") in words), None)
