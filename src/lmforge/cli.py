"""The ``lmforge`` command line.

The library's own commands live here: ``stage`` runs one stage without KFP (``lmforge stage NAME --help``
lists its inputs, outputs and config fields from the stage registry), ``presets`` and ``config`` show what
a run would use (``config --explain`` every field), ``serve`` starts the predictor for a release on this
machine, ``registry gc`` maintains a release registry. Commands
of other installed packages plug in through the ``lmforge.commands`` entry point group: the KFP layer
(``lmforge_kfp``) adds ``run``, ``compile``, ``images``, ``submit``, ``schedule`` and ``runs``. Importing
this module imports no plugin (and so no ``kfp``); :func:`main` loads them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from lmforge.cli_help import config_values, explain_fields, print_stage_help
from lmforge.component_io import cap_credential_loggers
from lmforge.config import describe_preset, list_presets, load_preset, parse_overrides
from lmforge.errors import LmforgeError, did_you_mean
from lmforge.stages import STAGES, get_stage, resolve_config, resolve_stage_config, sections

PLUGIN_GROUP = "lmforge.commands"
app = typer.Typer(add_completion=False, no_args_is_help=True, help="lmforge: raw text to a deployable LM.")
console = Console(stderr=True)

PresetOpt = Annotated[str, typer.Option("--preset", "-p", help="Config preset (see `lmforge presets`).")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="Override SECTION.FIELD=VALUE (VALUE parsed as JSON), e.g. pretrain.train.max_steps=50 "
        "(every field: `lmforge config --explain SECTION`).",
    ),
]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Log everything (DEBUG).")]


def setup_cli_logging(verbose: bool) -> None:
    """Readable log lines on stderr for a person at a terminal; never a credential, even with ``-v``."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(name)s: %(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
        force=True,
    )
    cap_credential_loggers()


def parse_assignments(items: list[str] | None, what: str) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` → ``{"a.b": 1, "c": "x"}``; values are JSON when they parse, else strings."""
    parsed: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise LmforgeError(f"{what} {item!r}: expected KEY=VALUE")
        try:
            parsed[key] = json.loads(raw)
        except json.JSONDecodeError:
            parsed[key] = raw
    return parsed


def overrides_by_section(assignments: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Split ``{"pretrain.train.lr": 1e-3}`` into ``{"pretrain": {"train.lr": 1e-3}}``."""
    by_section: dict[str, dict[str, Any]] = {}
    for key, value in assignments.items():
        section, _, field = key.partition(".")
        if section not in sections() or not field:
            raise LmforgeError(
                f"override {key!r}: expected SECTION.FIELD with SECTION one of {', '.join(sections())}"
                + did_you_mean(section, sections())
            )
        by_section.setdefault(section, {})[field] = value
    return by_section


def fail(exc: LmforgeError) -> None:
    """Print ``error: <message>`` as the last line (no traceback) and exit with code 2."""
    console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


@app.command(context_settings={"help_option_names": []})
def stage(
    name: Annotated[str, typer.Argument(help=f"Stage: {', '.join(STAGES)}.")],
    io: Annotated[
        list[str] | None,
        typer.Option("--io", help="NAME=PATH for each input, output and parameter of the stage."),
    ] = None,
    preset: PresetOpt = "tiny-cpu",
    set_: SetOpt = None,
    result_uri: Annotated[
        str,
        typer.Option(
            "--result",
            help="Also write the result (metrics, summary, HTML report) as JSON to this path or s3:// URI "
            "(rank 0 only under torchrun).",
        ),
    ] = "",
    help_: Annotated[bool, typer.Option("--help", "-h", help="Show the stage's inputs, outputs and config.")] = False,
    all_: Annotated[
        bool, typer.Option("--all", help="With --help: each config field's type, default, value and description.")
    ] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Run one stage without KFP, e.g. `lmforge stage clean --io corpus_uri=raw.jsonl --io cleaned=out/`.

    Artifact inputs and outputs may be s3:// prefixes (downloaded / uploaded around the stage); under torchrun
    every rank runs the stage and rank 0 writes the outputs and the result. `lmforge stage NAME --help` lists
    what NAME takes.
    """
    from lmforge.component_io import setup_logging
    from lmforge.launch.stage_runner import run_stage_uris
    from lmforge.run_context import RunContext

    try:
        spec = get_stage(name)
        if help_:
            relative = _stage_relative(spec, parse_assignments(set_, "--set")) if spec.section else {}
            values, source = _help_values(preset, {f"{spec.section}.{k}": v for k, v in relative.items()})
            print_stage_help(Console(), spec, values, source, every_field=all_)
            return
        if console.is_terminal:
            setup_cli_logging(verbose)
        else:  # a pod's or torchrun's log: one plain, unwrapped line per record
            setup_logging(logging.DEBUG if verbose else logging.INFO)
        paths = {k: str(v) for k, v in parse_assignments(io, "--io").items()}
        cfg = resolve_stage_config(
            name, preset, parse_overrides(_stage_relative(spec, parse_assignments(set_, "--set")))
        )
        context = RunContext.from_env().stage_context(preset)
        result = run_stage_uris(name, cfg, paths, result_uri=result_uri or None, context=context)
    except LmforgeError as exc:
        fail(exc)
    typer.echo(json.dumps({"metrics": result.metrics, "summary": result.summary}, indent=2, default=str))


def _stage_relative(spec: Any, assignments: dict[str, Any]) -> dict[str, Any]:
    """``--set`` for one stage: ``SECTION.FIELD`` as for ``run`` (its own section only), or ``FIELD`` alone."""
    relative = {}
    for key, value in assignments.items():
        head, _, rest = key.partition(".")
        if head in sections() and rest:
            if head != spec.section:
                raise LmforgeError(
                    f"--set {key}: stage {spec.name} reads config section {spec.section!r}, not {head!r}"
                )
            key = rest
        relative[key] = value
    return relative


def _help_values(preset: str, assignments: dict[str, Any]) -> tuple[dict[str, str], str]:
    """Every field's value under ``preset`` and ``--set`` (for the help), and how to name where it came from."""
    resolved = resolve_config(preset, assignments).model_dump(mode="json")
    return config_values(resolved), f"preset {preset}" + (" with --set" if assignments else "")


@app.command()
def presets() -> None:
    """List the presets shipped with the package, with the model size and the hardware each is meant for."""
    table = Table(show_lines=False)
    for column in ("preset", "model", "for"):
        table.add_column(column, overflow="fold")
    for name in list_presets():
        model = load_preset(name).get("pretrain", {}).get("model", {})
        shape = f"{model.get('arch', 'gpt2')} {model.get('n_layer', '?')}x{model.get('n_embd', '?')}"
        table.add_row(name, shape, describe_preset(name))
    Console().print(table)


@app.command()
def config(
    preset: PresetOpt = "tiny-cpu",
    set_: SetOpt = None,
    explain_: Annotated[
        str,
        typer.Option(
            "--explain",
            help="Instead of the resolved config, list the fields of SECTION or SECTION.FIELD with type, default, "
            "the value under --preset and --set, and description, e.g. --explain pretrain.train",
        ),
    ] = "",
) -> None:
    """Print the fully resolved configuration (preset + overrides) as YAML, or explain its fields."""
    try:
        if explain_:
            explain_fields(Console(), explain_, *_help_values(preset, parse_assignments(set_, "--set")))
            return
        resolved = resolve_config(preset, parse_assignments(set_, "--set"))
    except LmforgeError as exc:
        fail(exc)
    typer.echo(yaml.safe_dump(resolved.model_dump(), sort_keys=False))


@app.command()
def serve(
    path: Annotated[
        str,
        typer.Argument(
            help="A release models/<name>/<version>/ (local or s3://) or an ONNX model directory "
            "(export_onnx / quantize_int8 output)."
        ),
    ],
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="HTTP port.")] = 8080,
    host: Annotated[
        str, typer.Option("--host", help="Address to listen on; 0.0.0.0 also answers other machines.")
    ] = "127.0.0.1",
    preset: PresetOpt = "tiny-cpu",
    set_: SetOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Serve a release on this machine with the lmforge predictor (KServe's ModelServer, ONNX Runtime, KV cache,
    dynamic batching) until Ctrl-C: /v1/models/NAME:predict, /v2/models/NAME/infer, /openai/v1/completions.

    `--set serve.max_batch_size=16` sets its fields (`lmforge config --explain serve`); curl examples: docs/serve.md.
    """
    from lmforge import storage
    from lmforge.serve.model_dir import resolve_served_model

    setup_cli_logging(verbose)
    try:
        by_section = overrides_by_section(parse_assignments(set_, "--set"))
        if other := sorted(set(by_section) - {"serve"}):
            raise LmforgeError(f"--set {other[0]}.…: lmforge serve reads only the serve section (--set serve.FIELD=V)")
        cfg = resolve_stage_config("serve", preset, by_section.get("serve", {}))
        if not storage.is_s3(path):  # a wrong path fails now, not after kserve and ONNX Runtime have loaded
            resolve_served_model(path, prefer_int8=cfg.prefer_int8)
        try:
            from lmforge.serve.server import serve_model
        except ModuleNotFoundError as exc:
            if (exc.name or "").partition(".")[0] != "kserve":
                raise
            raise LmforgeError("lmforge serve needs the serve extra: pip install 'lmforge[serve]'") from exc
        serve_model(path, host=host, port=port, cfg=cfg)
    except LmforgeError as exc:
        fail(exc)


@app.command()
def plan(
    preset: PresetOpt = "tiny-cpu",
    set_: SetOpt = None,
    launch: Annotated[
        str, typer.Option("--launch", help="The training steps' LaunchConfig JSON (num_nodes, gpus_per_node).")
    ] = "{}",
    gpu: Annotated[str, typer.Option("--gpu", help="Accelerator type: H200, H100, A100, L40S, A10G or L4.")] = "H100",
    mfu: Annotated[
        float, typer.Option("--mfu", min=0.01, max=1.0, help="Assumed model FLOPs utilization for the hours.")
    ] = 0.4,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON instead of a table.")] = False,
) -> None:
    """What each training stage will cost before any GPU is requested: parameters, tokens, FLOPs, memory per GPU,
    hours and GPU-hours; refuses a plan whose memory exceeds the accelerator's."""
    from lmforge.config import LaunchConfig
    from lmforge.plan import Accelerator, plan_training, refuse_oversized

    try:
        resolved = resolve_config(preset, parse_assignments(set_, "--set"))
        accelerator = Accelerator.named(gpu)
        launch_cfg = LaunchConfig.model_validate(parse_overrides(launch))
        plans = plan_training(
            resolved, vocab_size=resolved.tokenize.vocab_size, launch=launch_cfg, accelerator=accelerator, mfu=mfu
        )
        if as_json:
            typer.echo(json.dumps([p.as_dict() for p in plans], indent=1))
        else:
            _print_plan(plans, f"{preset} on {launch_cfg.num_nodes}x{launch_cfg.gpus_per_node} {gpu}, MFU {mfu:.0%}")
        refuse_oversized(plans, accelerator)
    except LmforgeError as exc:
        fail(exc)


def _print_plan(plans: list[Any], title: str) -> None:
    table = Table(title=title)
    table.add_column("stage", no_wrap=True)
    for column in ("params", "trained", "tokens", "FLOPs", "GB/GPU", "hours", "GPU-h"):
        table.add_column(column, justify="right")
    for p in plans:
        table.add_row(
            p.stage,
            _short(p.parameters),
            _short(p.trained_parameters),
            _short(p.tokens),
            _short(p.flops),
            f"{p.memory_gb_per_gpu:.1f}",
            _short(p.hours),
            _short(p.gpu_hours),
        )
    Console().print(table)


def _short(value: float) -> str:
    """Three significant digits with an SI suffix: 1.18G, 210G, 0.124."""
    exponent = 0
    while abs(value) >= 1000 and exponent < 8:
        value, exponent = value / 1000, exponent + 1
    return f"{value:.3g}{' kMGTPEZY'[exponent].strip()}"


@app.command()
def push(
    release: Annotated[str, typer.Argument(help="A release models/<name>/<version>/ (local or s3://).")],
    to: Annotated[str, typer.Option("--to", help="Hugging Face Hub repository: hf://<org>/<name>.")],
    artifact: Annotated[
        str, typer.Option("--artifact", help="Release folder to upload with its model card: student or an ONNX one.")
    ] = "student",
    token: Annotated[
        str | None, typer.Option("--token", help="Hub token (default $HF_TOKEN); the hub is $HF_ENDPOINT.")
    ] = None,
    verbose: VerboseOpt = False,
) -> None:
    """Upload a release folder and its model card (README.md) to the Hugging Face Hub with huggingface_hub."""
    setup_cli_logging(verbose)
    from lmforge.release.model_card import push as push_release

    try:
        url = push_release(release, to, artifact=artifact, token=token)
    except LmforgeError as exc:
        fail(exc)
    typer.echo(f"pushed {artifact} of {release} to {to}: {url}")


registry_app = typer.Typer(no_args_is_help=True, help="Maintain a release registry (or a staging prefix).")
app.add_typer(registry_app, name="registry")


@registry_app.command("gc")
def registry_gc(
    root: Annotated[str, typer.Argument(help="Release root or staging prefix: a local path or s3://bucket/prefix.")],
    older_than_hours: Annotated[
        float,
        typer.Option(
            "--older-than-hours",
            min=0.0,
            help="Only claims and multipart uploads older than this (a younger one may still be running).",
        ),
    ] = 24.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would be removed.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Remove stale claims of interrupted promotions and publishes, and abort old incomplete multipart uploads."""
    setup_cli_logging(verbose)
    from lmforge.release.gc import collect_garbage

    try:
        done = collect_garbage(root, older_than_s=older_than_hours * 3600, dry_run=dry_run)
    except LmforgeError as exc:
        fail(exc)
    verb = "would remove" if dry_run else "removed"
    for what, items in done.items():
        for item in items:
            typer.echo(f"{verb} {what[:-1]} {item}")
    if not any(done.values()):
        typer.echo(f"nothing to clean under {root}")


def load_plugins(target: typer.Typer = app) -> list[str]:
    """Let every installed ``lmforge.commands`` entry point add its commands to ``target``; their names."""
    loaded = []
    for entry in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        register: Callable[[typer.Typer], None] = entry.load()
        register(target)
        loaded.append(entry.name)
    return loaded


_PLUGINS_LOADED: list[str] = []


def application() -> typer.Typer:
    """The ``lmforge`` app with every installed plugin's commands (loaded once)."""
    if not _PLUGINS_LOADED:
        _PLUGINS_LOADED.extend(load_plugins(app) or ["-"])
    return app


def main() -> None:
    """The ``lmforge`` console script: the library's commands plus the plugins'."""
    application()()
