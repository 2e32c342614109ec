"""Call a registered stage's entry point with its ports by name, checking them against the registry first."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from lmforge.errors import ConfigError, did_you_mean
from lmforge.results import StageResult
from lmforge.stages.registry import get_stage
from lmforge.stages.spec import Port, StageSpec
from lmforge.tracking.stages import tracked_stage


def run_stage(name: str, cfg: Any, io: Mapping[str, Any], *, context: Mapping[str, str] | None = None) -> StageResult:
    """Run stage ``name`` with ``io`` holding its inputs and outputs by name (what ``lmforge stage`` runs).

    Values may be strings as typed on a command line: an integer parameter ``"3"`` becomes ``3``, a list
    of artifacts ``"a,b"`` becomes ``["a", "b"]``. Empty values count as not given. ``context`` holds the
    run's ``preset`` and ``run_id`` (and ``pipeline_version``); a stage gets those its ``StageSpec.context``
    names. With MLflow tracking on, the stage runs inside its MLflow run (:mod:`lmforge.tracking.stages`).

    Raises:
        ConfigError: an unknown name (the nearest valid one is named), a missing required input or output
            (named with its description), or a value of the wrong type; nothing has run.
    """
    spec = get_stage(name)
    ports = bind(spec, io)
    kwargs = ports | {key: value for key, value in (context or {}).items() if key in spec.context}
    function = spec.function()
    with tracked_stage(spec, cfg, ports, context) as tracked:
        tracked.result = function(cfg, **kwargs) if spec.config is not None else function(**kwargs)
    return tracked.result


def bind(spec: StageSpec, io: Mapping[str, Any]) -> dict[str, Any]:
    """The entry point's keyword arguments for ``io``, converted to each port's kind and checked."""
    known = {port.name for port in spec.ports}
    if unknown := [key for key in io if key not in known]:
        hints = ", ".join(f"{key!r}{did_you_mean(key, known)}" for key in unknown)
        raise ConfigError(f"stage {spec.name}: unknown argument(s) {hints}; it takes {', '.join(sorted(known))}")
    given = {key: value for key, value in io.items() if value not in (None, "", [], ())}
    if missing := [port for port in spec.ports if port.required and port.name not in given]:
        raise ConfigError(
            f"stage {spec.name}: missing "
            + "; ".join(f"{_role(spec, port)} {port.name!r} ({port.description})" for port in missing)
            + f" — pass {' '.join(f'--io {port.name}=...' for port in missing)}"
        )
    return {port.name: _convert(spec, port, given[port.name]) for port in spec.ports if port.name in given}


def _role(spec: StageSpec, port: Port) -> str:
    return "output" if port in spec.outputs else "input"


def _convert(spec: StageSpec, port: Port, value: Any) -> Any:
    where = f"stage {spec.name}: {port.name}"
    if port.is_artifact:
        if port.many:
            items = value.split(",") if isinstance(value, str) else list(value)
            return [str(item) for item in items if str(item)]
        return str(value)
    if not isinstance(value, str) or port.kind == "str":
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: expected {port.kind}, got {value!r}") from exc
    expected = {"int": int, "bool": bool, "dict": dict, "list": list, "list[int]": list}[port.kind]
    if not isinstance(parsed, expected) or (expected is int and isinstance(parsed, bool)):
        raise ConfigError(f"{where}: expected {port.kind}, got {value!r}")
    return parsed
