"""Help that fits the terminal: config fields and a stage's ports for ``config --explain`` and ``stage --help``.

Each field is its dotted name on a line, then, indented, its type, default and the value the chosen preset (and
``--set``) gives it, then its description, wrapped by rich to the console's width: nothing is sized to the longest
name, so 80 columns read as well as 200. ``stage NAME --help`` lists the config fields by name only (a page on a
terminal); ``--all`` adds each one's type, value and description.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.text import Text

from lmforge.stages import explain
from lmforge.stages.configs import FieldHelp

INDENT = 4
_MISSING = object()


def config_values(resolved: Mapping[str, Any]) -> dict[str, str]:
    """Every leaf of a resolved config (``model_dump(mode="json")``) by dotted path, as JSON as ``explain`` shows."""
    values: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping) and node:
            for key, child in node.items():
                walk(child, f"{prefix}.{key}" if prefix else str(key))
        else:
            values[prefix] = json.dumps(node)

    walk(resolved, "")
    return values


def field_groups(names: Iterable[str]) -> list[str]:
    """Field names in a line per nested model: ``a, b`` for top-level fields, then ``model.{x, y}`` for each model."""
    groups: dict[str, list[str]] = {}
    for name in names:
        head, _, rest = name.rpartition(".")
        groups.setdefault(head, []).append(rest)
    top = groups.pop("", [])
    return ([", ".join(top)] if top else []) + [f"{head}.{{{', '.join(rest)}}}" for head, rest in groups.items()]


def print_indented(out: Console, text: Text, first: int = INDENT, rest: int = INDENT) -> None:
    """Print ``text`` wrapped to ``out``'s width: its first line after ``first`` spaces, the others after ``rest``."""
    for number, line in enumerate(text.wrap(out, max(20, out.width - max(first, rest)))):
        line.rstrip()
        out.print(Text(" " * (rest if number else first)) + line, soft_wrap=True)


def print_fields(out: Console, rows: Sequence[FieldHelp], values: Mapping[str, str], source: str) -> None:
    """Print ``rows`` as name, then (indented) type, default, the value ``source`` sets when it differs, description.

    Args:
        out: the console to print on (its width wraps every line).
        rows: fields from :func:`lmforge.stages.explain`.
        values: resolved values by dotted path (:func:`config_values`); a field missing there shows its default only.
        source: what set ``values`` (``preset tiny-cpu``), named beside a value that differs from the default.
    """
    for row in rows:
        out.print(Text(row.path, style="bold"))
        facts = f"{row.type}, default {row.default}"
        value = values.get(row.path, _MISSING)
        if value is not _MISSING and value != row.default:
            facts += f"; {source}: {value}"
        print_indented(out, Text(facts, style="dim"))
        if row.description:
            print_indented(out, Text(row.description))


def explain_fields(out: Console, target: str, values: Mapping[str, str], source: str) -> None:
    """``config --explain TARGET``: every field under ``target`` (raises ``ConfigError`` for an unknown one)."""
    print_fields(out, explain(target), values, source)


def print_stage_help(out: Console, spec: Any, values: Mapping[str, str], source: str, *, every_field: bool) -> None:
    """``stage NAME --help``: usage, summary, each input and output, and the stage's config fields.

    Without ``every_field`` the fields are listed by name only, with a pointer to ``--all`` and ``config --explain``.
    """
    out.print(Text.assemble(("lmforge stage ", "bold"), (spec.name, "bold"), " --io NAME=VALUE ... [--set FIELD=V]"))
    print_indented(out, Text(spec.summary), 0, 0)
    for title, ports in (("inputs", spec.inputs), ("outputs", spec.outputs)):
        out.print(Text(f"\n{title}:", style="bold"))
        for port in ports:
            required = "required" if port.required else "optional"
            if not port.required and not port.is_artifact:
                required = f"default {port.default!r}"
            kind = port.kind + ("[]" if port.many else "")
            print_indented(out, Text.assemble((port.name, "bold"), f" ({kind}, {required})"), 2)
            print_indented(out, Text(port.description))
    if not spec.section:
        out.print(Text("\nconfig: none"))
        return
    rows = explain(spec.section)
    out.print(
        Text(
            f"\nconfig: section {spec.section} ({spec.config.__name__}, {len(rows)} fields); "
            f"--set {spec.section}.FIELD=VALUE",
            style="bold",
        )
    )
    if every_field:
        print_fields(out, rows, values, source)
        return
    for group in field_groups(row.path.removeprefix(f"{spec.section}.") for row in rows):
        print_indented(out, Text(group), 2, INDENT)
    out.print(
        Text(
            f"Each field's type, default, {source} value and description: lmforge stage {spec.name} --help --all "
            f"(or lmforge config --explain {spec.section}[.FIELD])."
        )
    )
