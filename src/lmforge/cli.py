"""The ``lmforge`` command line.

``run`` executes the whole DAG locally with ``kfp.local`` (the demo corpus by default), ``compile``
writes every component and pipeline YAML, ``stage`` runs one stage without KFP, ``presets`` and
``config`` show what a run would use. The KFP-dependent commands import the ``pipelines`` package
lazily, so the library itself stays free of ``kfp``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from lmforge.component_io import cap_credential_loggers
from lmforge.config import STAGES, list_presets, parse_overrides, resolve_config, resolve_stage_config
from lmforge.errors import LmforgeError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="lmforge: raw text to a deployable LM.")
console = Console(stderr=True)

PresetOpt = Annotated[str, typer.Option("--preset", "-p", help="Config preset (see `lmforge presets`).")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="Override STAGE.FIELD=VALUE (VALUE parsed as JSON), e.g. pretrain.train.max_steps=50.",
    ),
]


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(name)s: %(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
        force=True,
    )
    cap_credential_loggers()


def _parse_assignments(items: list[str] | None, what: str) -> dict[str, Any]:
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


def _overrides_by_stage(assignments: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Split ``{"pretrain.train.lr": 1e-3}`` into ``{"pretrain": {"train.lr": 1e-3}}``."""
    by_stage: dict[str, dict[str, Any]] = {}
    for key, value in assignments.items():
        stage, _, field = key.partition(".")
        if stage not in STAGES or not field:
            raise LmforgeError(f"override {key!r}: expected STAGE.FIELD with STAGE one of {', '.join(STAGES)}")
        by_stage.setdefault(stage, {})[field] = value
    return by_stage


def _fail(exc: LmforgeError) -> None:
    console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


@app.command()
def run(
    preset: PresetOpt = "tiny-cpu",
    corpus: Annotated[str, typer.Option(help="Raw corpus URI (local, s3://, demo://).")] = "demo://shakespeare",
    qa: Annotated[str, typer.Option(help="Q&A JSONL URI for LoRA (local, s3://, demo://).")] = "demo://chatterbot",
    output: Annotated[Path, typer.Option("--output", "-o", help="Where runs and the registry go.")] = Path(
        "lmforge-out"
    ),
    release_root: Annotated[str, typer.Option(help="Registry root; default <output>/registry.")] = "",
    version: Annotated[str, typer.Option(help="Release version; default a UTC timestamp.")] = "",
    set_: SetOpt = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run the whole DAG locally (kfp.local, one subprocess per stage) and print the summary."""
    _setup_logging(verbose)
    try:
        by_stage = _overrides_by_stage(_parse_assignments(set_, "--set"))
        resolve_config(preset, {f"{s}.{k}": v for s, fields in by_stage.items() for k, v in fields.items()})
        from pipelines.local_run import run_pipeline_locally

        params: dict[str, Any] = {
            "corpus_uri": corpus,
            "qa_uri": qa,
            "preset": preset,
            "release_root": release_root or str((output / "registry").resolve()),
            "release_version": version,
            **{f"{stage}_overrides": json.dumps(fields) for stage, fields in by_stage.items()},
        }
        local_run = run_pipeline_locally(params, output / "runs")
    except LmforgeError as exc:
        _fail(exc)
    _print_summary(local_run)


def _print_summary(local_run: Any) -> None:
    evaluation = local_run.output("evaluate", "evaluation")
    results = json.loads((evaluation / "results.json").read_text(encoding="utf-8"))
    table = Table(title=f"lmforge run — {local_run.seconds:.0f} s", show_lines=False)
    for column in ("model", "perplexity", "size MB", "p50 ms", "p99 ms"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for name, row in results["models"].items():
        table.add_row(
            name,
            *(_fmt(row.get(key)) for key in ("perplexity", "size_mb", "p50_ms", "p99_ms")),
        )
    out = Console()
    out.print(table)
    verdict = "[green]passed[/]" if results["passed"] else "[red]failed[/]"
    out.print(f"gate: {verdict}; promoted: {'yes' if local_run.promoted else 'no'}")
    out.print(f"report: {evaluation / 'report.html'}")
    out.print(f"run directory: {local_run.run_dir}")


def _fmt(value: Any) -> str:
    return "—" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


@app.command("compile")
def compile_(
    root: Annotated[Path | None, typer.Option(help="Repository root to write into (default: this checkout).")] = None,
    registry: Annotated[
        str | None,
        typer.Option(
            help="Image registry the steps pull from, e.g. registry.example.com/ml (what `make images` "
            "pushed to); default: $LMFORGE_IMAGE_REGISTRY, else ghcr.io/lmforge."
        ),
    ] = None,
) -> None:
    """Compile every component (components/*/component.yaml) and pipeline (pipelines/compiled/*.yaml)."""
    if registry:
        os.environ["LMFORGE_IMAGE_REGISTRY"] = registry
    from pipelines.compile import REPO_ROOT, compile_all

    for path in compile_all(root or REPO_ROOT):
        typer.echo(str(path))


@app.command()
def images(
    tag: Annotated[bool, typer.Option("--tag", help="Print only the tag (what `make images` builds under).")] = False,
) -> None:
    """The runtime images the compiled pipeline pulls: <registry>/lmforge-<runtime>:<version>-<source hash>."""
    from components.images import RUNTIME_OF_COMPONENT, image_for, image_tag

    if tag:
        typer.echo(image_tag())
        return
    for runtime in sorted(set(RUNTIME_OF_COMPONENT.values())):
        component = next(c for c, r in RUNTIME_OF_COMPONENT.items() if r == runtime)
        typer.echo(f"{runtime}\t{image_for(component)}")


@app.command()
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
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run one stage without KFP, e.g. `lmforge stage clean --io corpus_uri=raw.jsonl --io cleaned=out/`.

    Artifact inputs and outputs may be s3:// prefixes (downloaded / uploaded around the stage); under torchrun
    every rank runs the stage and rank 0 writes the outputs and the result.
    """
    from lmforge.component_io import setup_logging
    from lmforge.launch.stage_runner import run_stage_uris

    if console.is_terminal:
        _setup_logging(verbose)
    else:  # a pod's or torchrun's log: one plain, unwrapped line per record
        setup_logging(logging.DEBUG if verbose else logging.INFO)
    try:
        paths = {k: str(v) for k, v in _parse_assignments(io, "--io").items()}
        cfg = resolve_stage_config(name, preset, parse_overrides(_parse_assignments(set_, "--set")))
        result = run_stage_uris(name, cfg, paths, result_uri=result_uri or None)
    except LmforgeError as exc:
        _fail(exc)
    typer.echo(json.dumps({"metrics": result.metrics, "summary": result.summary}, indent=2, default=str))


@app.command()
def presets() -> None:
    """List the presets shipped with the package."""
    for name in list_presets():
        typer.echo(name)


@app.command()
def config(preset: PresetOpt = "tiny-cpu", set_: SetOpt = None) -> None:
    """Print the fully resolved configuration (preset + overrides) as YAML."""
    try:
        resolved = resolve_config(preset, _parse_assignments(set_, "--set"))
    except LmforgeError as exc:
        _fail(exc)
    typer.echo(yaml.safe_dump(resolved.model_dump(), sort_keys=False))


# -- Kubeflow Pipelines server: submit, schedule, runs ---------------------------------------------------------------

HostOpt = Annotated[
    str,
    typer.Option("--host", help="KFP API server URL, e.g. http://localhost:8080 (port-forward of ml-pipeline-ui)."),
]
ParamOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--param",
        help="Pipeline parameter NAME=VALUE, converted to the parameter's type, e.g. gpu_count=2 "
        "or release_root=s3://bucket/releases.",
    ),
]
ExperimentOpt = Annotated[str, typer.Option("--experiment", help="Experiment name; created when missing.")]
NamespaceOpt = Annotated[
    str,
    typer.Option(
        "--namespace",
        envvar="LMFORGE_KFP_NAMESPACE",
        help="Kubeflow profile namespace of a multi-user deployment (default '': single-user KFP).",
    ),
]
ServiceAccountOpt = Annotated[
    str,
    typer.Option(
        "--service-account",
        help="Service account the run's pods use (default: the server's, pipeline-runner or default-editor).",
    ),
]
TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token",
        envvar="LMFORGE_KFP_TOKEN",
        show_default=False,
        help="Bearer token for a multi-user KFP API (e.g. `kubectl create token SA --audience=pipelines.kubeflow."
        "org`); else $KF_PIPELINES_SA_TOKEN_PATH names a token file, else no credentials (port-forward).",
    ),
]
PackageOpt = Annotated[
    Path | None,
    typer.Option("--package", help="Compiled pipeline YAML (default: pipelines/compiled/lmforge_pipeline.yaml)."),
]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v")]


def _setup_remote_logging(verbose: bool) -> None:
    _setup_logging(verbose)
    if not verbose:
        # urllib3 warns on every connection retry; an unreachable host is reported once, as the error line.
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)


def _remote_arguments(
    host: str, package_path: Path | None, preset: str, set_: list[str] | None, param: list[str] | None
) -> tuple[Any, dict[str, Any]]:
    """Validate everything locally (host, overrides, parameters, package) and return the package and arguments."""
    from pipelines import remote

    remote.check_host(host)
    assignments = _parse_assignments(set_, "--set")
    by_stage = _overrides_by_stage(assignments)
    resolve_config(preset, assignments)
    _parse_assignments(param, "--param")  # KEY=VALUE check; values are typed against the pipeline below
    raw_params = dict(item.split("=", 1) for item in param or [])
    package = remote.load_package(package_path or remote.COMPILED_PIPELINE)
    return package, remote.pipeline_arguments(package, preset, by_stage, raw_params)


def _describe_version(version: Any) -> str:
    return f"pipeline version {version.name} ({'uploaded' if version.uploaded else 'already on the server'})"


@app.command()
def submit(
    host: HostOpt,
    preset: PresetOpt = "tiny-cpu",
    set_: SetOpt = None,
    param: ParamOpt = None,
    experiment: ExperimentOpt = "lmforge",
    namespace: NamespaceOpt = "",
    service_account: ServiceAccountOpt = "",
    token: TokenOpt = None,
    run_name: Annotated[str, typer.Option("--run-name", help="Run name; default pipeline, version and time.")] = "",
    package: PackageOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Start a run on a Kubeflow Pipelines server (uploading the pipeline version if new); print the run URL."""
    _setup_remote_logging(verbose)
    try:
        pkg, arguments = _remote_arguments(host, package, preset, set_, param)
        from pipelines.remote import Remote

        submitted = Remote(host, namespace, token=token).submit(
            pkg, arguments, experiment=experiment, run_name=run_name, service_account=service_account
        )
    except LmforgeError as exc:
        _fail(exc)
    console.print(f"{_describe_version(submitted.version)}; experiment {experiment!r}", highlight=False, soft_wrap=True)
    console.print(f"run {submitted.run_name!r} created ({submitted.run_id})", highlight=False, soft_wrap=True)
    typer.echo(submitted.url)


@app.command()
def schedule(
    host: HostOpt,
    cron: Annotated[
        str,
        typer.Option("--cron", help="When to run: 5-field cron '0 3 * * 0' (Sundays 03:00) or KFP's 6-field form."),
    ],
    name: Annotated[str, typer.Option("--name", help="Recurring run name; an existing one is updated.")],
    preset: PresetOpt = "tiny-cpu",
    set_: SetOpt = None,
    param: ParamOpt = None,
    experiment: ExperimentOpt = "lmforge",
    namespace: NamespaceOpt = "",
    service_account: ServiceAccountOpt = "",
    token: TokenOpt = None,
    package: PackageOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Create or update a recurring run so it runs the current pipeline version; print its URL."""
    _setup_remote_logging(verbose)
    try:
        pkg, arguments = _remote_arguments(host, package, preset, set_, param)
        from pipelines.remote import Remote, kfp_cron

        kfp_cron(cron)  # reject a bad expression before contacting the server
        if not name.strip():
            raise LmforgeError("--name: a recurring run needs a name")
        scheduled = Remote(host, namespace, token=token).schedule(
            pkg, arguments, name=name, cron=cron, experiment=experiment, service_account=service_account
        )
    except LmforgeError as exc:
        _fail(exc)
    if scheduled.unchanged:
        what = "unchanged"
    elif scheduled.replaced:
        what = f"updated (replaced {', '.join(scheduled.replaced)})"
    else:
        what = "created"
    console.print(f"{_describe_version(scheduled.version)}; experiment {experiment!r}", highlight=False, soft_wrap=True)
    console.print(
        f"recurring run {name!r} {what}: {scheduled.recurring_run_id}, cron '{scheduled.cron}'",
        highlight=False,
        soft_wrap=True,
    )
    typer.echo(scheduled.url)


@app.command()
def runs(
    host: HostOpt,
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000, help="How many recent runs to show.")] = 20,
    experiment: Annotated[str, typer.Option("--experiment", help="Only runs of this experiment.")] = "",
    namespace: NamespaceOpt = "",
    token: TokenOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """List the most recent runs on a Kubeflow Pipelines server with their state."""
    _setup_remote_logging(verbose)
    try:
        from pipelines.remote import Remote, check_host

        check_host(host)
        rows = Remote(host, namespace, token=token).list_runs(limit=limit, experiment=experiment)
    except LmforgeError as exc:
        _fail(exc)
    table = Table(title=f"runs on {host.rstrip('/')}" + (f" — experiment {experiment}" if experiment else ""))
    for column in ("created (UTC)", "run", "state", "finished (UTC)", "run id"):
        table.add_column(column)
    styles = {"SUCCEEDED": "green", "FAILED": "red", "RUNNING": "cyan", "CANCELED": "yellow"}
    for row in rows:
        state = f"[{styles[row.state]}]{row.state}[/]" if row.state in styles else row.state
        table.add_row(
            _when(row.created_at), f"[link={row.url}]{row.name}[/link]", state, _when(row.finished_at), row.run_id
        )
    Console(width=max(Console().width, 140)).print(table)


def _when(moment: Any) -> str:
    return "—" if moment is None else f"{moment:%Y-%m-%d %H:%M}"


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
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Remove stale claims of interrupted promotions and publishes, and abort old incomplete multipart uploads."""
    _setup_logging(verbose)
    from lmforge.release import collect_garbage

    try:
        done = collect_garbage(root, older_than_s=older_than_hours * 3600, dry_run=dry_run)
    except LmforgeError as exc:
        _fail(exc)
    verb = "would remove" if dry_run else "removed"
    for what, items in done.items():
        for item in items:
            typer.echo(f"{verb} {what[:-1]} {item}")
    if not any(done.values()):
        typer.echo(f"nothing to clean under {root}")
