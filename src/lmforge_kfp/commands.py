"""The KFP commands of the ``lmforge`` CLI: run the DAG locally, compile it, submit, schedule and list runs.

:func:`register` adds them to the ``lmforge`` app (entry point group ``lmforge.commands``); ``kfp`` is
imported only inside the commands that need it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from lmforge.cli import (
    PresetOpt,
    SetOpt,
    VerboseOpt,
    console,
    fail,
    overrides_by_section,
    parse_assignments,
    setup_cli_logging,
)
from lmforge.errors import LmforgeError
from lmforge.stages import resolve_config

CorpusOpt = Annotated[
    str, typer.Option("--corpus", help="Raw corpus URI (pipeline parameter corpus_uri); default: the pipeline's.")
]
QaOpt = Annotated[str, typer.Option("--qa", help="Q&A JSONL URI (pipeline parameter qa_uri); default: the pipeline's.")]
ModelNameOpt = Annotated[
    str, typer.Option("--model-name", help="Release name (pipeline parameter model_name); default: from the corpus.")
]


def register(app: typer.Typer) -> None:
    """Add ``run``, ``compile``, ``images``, ``submit``, ``schedule`` and ``runs`` to ``app``."""
    app.command("run")(run)
    app.command("compile")(compile_)
    app.command("images")(images)
    app.command("submit")(submit)
    app.command("schedule")(schedule)
    app.command("runs")(runs)


def run(
    preset: PresetOpt = "tiny-cpu",
    corpus: Annotated[str, typer.Option(help="Raw corpus URI (local, s3://, demo://).")] = "demo://shakespeare",
    qa: Annotated[str, typer.Option(help="Q&A JSONL URI for LoRA (local, s3://, demo://).")] = "demo://chatterbot",
    base_model: Annotated[
        str,
        typer.Option(
            "--base-model",
            help="Hugging Face model directory (local or s3://) to start from instead of pretraining from scratch "
            "(pipeline parameter base_model_uri); its tokenizer is used.",
        ),
    ] = "",
    student_base: Annotated[
        str,
        typer.Option(
            "--student-base",
            help="Smaller pretrained model with the same tokenizer, distilled as the student (student_base_uri).",
        ),
    ] = "",
    output: Annotated[Path, typer.Option("--output", "-o", help="Where runs and the registry go.")] = Path(
        "lmforge-out"
    ),
    release_root: Annotated[str, typer.Option(help="Registry root; default <output>/registry.")] = "",
    version: Annotated[str, typer.Option(help="Release version; default a UTC timestamp.")] = "",
    model_name: Annotated[
        str, typer.Option("--model-name", help="Release name (models/<name>/); default: derived from the corpus.")
    ] = "",
    set_: SetOpt = None,
    runner: Annotated[
        str,
        typer.Option(
            help="subprocess: every task in this Python. docker or podman: every task in the image the compiled "
            "pipeline names, through the Docker API ($DOCKER_HOST, Docker's socket, or a podman system service "
            "lmforge starts), as the image's non-root user with a read-only root file system.",
        ),
    ] = "subprocess",
    container_network: Annotated[
        str, typer.Option(help="With --runner docker|podman: the tasks' network, none or host (S3, MLflow).")
    ] = "none",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only the final summary (for CI).")] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Print everything the stages and kfp.local write.")
    ] = False,
) -> None:
    """Run the whole DAG locally (kfp.local: one subprocess, or one container, per stage) and print what it made.

    By default one line per stage and the training progress; every line of every stage also goes to the run's
    logs/ folder. The last line of a failed run is the failing stage's own error.
    """
    setup_cli_logging(verbose)
    try:
        by_section = overrides_by_section(parse_assignments(set_, "--set"))
        resolve_config(preset, {f"{s}.{k}": v for s, fields in by_section.items() for k, v in fields.items()})
        from lmforge_kfp.pipelines.local_run import run_pipeline_locally

        params: dict[str, Any] = {
            "corpus_uri": corpus,
            "qa_uri": qa,
            "base_model_uri": base_model,
            "student_base_uri": student_base,
            "preset": preset,
            "release_root": release_root or str((output / "registry").resolve()),
            "release_version": version,
            "model_name": model_name,
            **{f"{stage}_overrides": json.dumps(fields) for stage, fields in by_section.items()},
        }
        mode = "verbose" if verbose else "quiet" if quiet else "default"
        containers = _container_settings(runner, container_network, output, params)
        local_run = run_pipeline_locally(params, output / "runs", console=mode, runner=runner, containers=containers)
    except LmforgeError as exc:
        fail(exc)
    _print_summary(local_run, quiet=quiet)


def _container_settings(runner: str, network: str, output: Path, params: dict[str, Any]) -> Any:
    """The containers' mounts (the output folder, a local release root elsewhere, local inputs read-only)."""
    from lmforge_kfp.containers import ContainerSettings

    if runner == "subprocess":
        return None
    if network not in ("none", "host"):
        raise LmforgeError(f"--container-network {network!r}: expected none or host")
    output.mkdir(parents=True, exist_ok=True)
    mounts = [output.resolve()]
    if "://" not in params["release_root"] and not Path(params["release_root"]).resolve().is_relative_to(mounts[0]):
        mounts.append(Path(params["release_root"]).resolve())
    inputs = ("corpus_uri", "qa_uri", "base_model_uri", "student_base_uri")
    local_inputs = tuple(Path(params[name]).resolve() for name in inputs if params[name] and "://" not in params[name])
    return ContainerSettings(mounts=tuple(mounts), read_only_mounts=local_inputs, network=network)


def _print_summary(local_run: Any, *, quiet: bool) -> None:
    """The model table (not with ``--quiet``) and the summary lines, each path whole on its own line."""
    from lmforge_kfp.pipelines.summary import MODEL_COLUMNS, model_rows, summary_lines

    evaluation = local_run.output("evaluate", "evaluation")
    results = json.loads((evaluation / "results.json").read_text(encoding="utf-8"))
    typer.echo(f"lmforge run {local_run.run_id}: {local_run.seconds:.0f} s")
    if not quiet:
        table = Table(show_lines=False, box=None)
        table.add_column("model")
        for _, title in MODEL_COLUMNS:
            table.add_column(title, justify="right")
        for row in model_rows(results):
            table.add_row(*row)
        Console().print(table)
    for line in summary_lines(local_run):
        typer.echo(line)
    # The headline: the served model's empty answers and answer loss vs the teacher, the teacher's bits/byte vs the
    # base, data retention and the gate's warnings (evaluate's results.json "headline")
    from lmforge.evaluate.gate import headline_lines

    for line in headline_lines(results.get("headline") or {}):
        typer.echo(line)
    from lmforge.evaluate.harness import summary_lines as harness_lines

    for line in harness_lines(results.get("harness") or {}):
        typer.echo(line)
    for line in results.get("verdict") or []:
        typer.echo(f"verdict: {line}")
    typer.echo(_serve_hint(local_run))


def _serve_hint(local_run: Any) -> str:
    """How to start the predictor for the new release (the serve step's ``local_command``), or why there is none."""
    status = local_run.output("serve", "serving") / "status.json"
    if not status.is_file():
        return "serve: nothing released, nothing to serve"
    return f"serve it: {json.loads(status.read_text(encoding='utf-8'))['local_command']}"


def compile_(
    root: Annotated[Path | None, typer.Option(help="Repository root to write into (default: this checkout).")] = None,
    registry: Annotated[
        str | None,
        typer.Option(
            help="Image registry the steps pull from, e.g. registry.example.com/ml (what `make images` "
            "pushed to); default: $LMFORGE_IMAGE_REGISTRY, else ghcr.io/lmforge."
        ),
    ] = None,
    image_tag: Annotated[
        str | None,
        typer.Option(
            "--image-tag",
            help="Tag of the images the steps pull; default $LMFORGE_IMAGE_TAG, else the package version: the "
            "release tag, what a release publishes and the committed YAML names. `content`: <version>-<source "
            "hash> (`lmforge images --tag`), what `make images` builds and pushes: use it for images you build "
            "yourself, so KFP's cache (keyed on the image) never reuses a step an older image ran.",
        ),
    ] = None,
) -> None:
    """Compile every component (components/*/component.yaml) and pipeline (pipelines/compiled/*.yaml)."""
    from lmforge_kfp.components.images import REGISTRY_ENV, TAG_ENV

    if registry:
        os.environ[REGISTRY_ENV] = registry
    if image_tag:
        os.environ[TAG_ENV] = image_tag
    from lmforge_kfp.pipelines.compile import REPO_ROOT, compile_all

    try:
        written = compile_all(root or REPO_ROOT)
    except LmforgeError as exc:
        fail(exc)
    for path in written:
        typer.echo(str(path))


def images(
    tag: Annotated[
        bool, typer.Option("--tag", help="Print only the content tag (what `make images` builds and pushes).")
    ] = False,
) -> None:
    """The images the compiled pipeline pulls or deploys: <registry>/lmforge-<runtime>:<tag>.

    The tag is the release tag (the package version), or what $LMFORGE_IMAGE_TAG says (`content`: the content tag).
    """
    from lmforge.stages import STAGES
    from lmforge_kfp.components.images import SERVICE_IMAGES, content_tag, image_for, service_image

    if tag:
        typer.echo(content_tag())
        return
    try:
        for runtime in sorted({spec.runtime for spec in STAGES.values()}):
            stage = next(name for name, spec in STAGES.items() if spec.runtime == runtime)
            typer.echo(f"{runtime}\t{image_for(stage)}")
        for name in SERVICE_IMAGES:  # no step runs in these; the serve step's InferenceService does
            typer.echo(f"{name}\t{service_image(name)}")
    except LmforgeError as exc:  # a $LMFORGE_IMAGE_TAG that is no tag
        fail(exc)


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


def _setup_remote_logging(verbose: bool) -> None:
    setup_cli_logging(verbose)
    if not verbose:
        # urllib3 warns on every connection retry; an unreachable host is reported once, as the error line.
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)


def _remote_arguments(
    host: str,
    package_path: Path | None,
    preset: str,
    set_: list[str] | None,
    param: list[str] | None,
    data: dict[str, str],
) -> tuple[Any, dict[str, Any]]:
    """Validate everything locally (host, overrides, parameters, package) and return the package and arguments.

    ``data`` holds the pipeline parameters given as their own options (``--corpus``, ``--qa``, ``--model-name``);
    an empty one keeps the pipeline's default.
    """
    from lmforge_kfp.pipelines import remote

    remote.check_host(host)
    assignments = parse_assignments(set_, "--set")
    by_section = overrides_by_section(assignments)
    resolve_config(preset, assignments)
    parse_assignments(param, "--param")  # KEY=VALUE check; values are typed against the pipeline below
    raw_params = {name: value for name, value in data.items() if value}
    raw_params |= dict(item.split("=", 1) for item in param or [])
    package = remote.load_package(package_path or remote.COMPILED_PIPELINE)
    return package, remote.pipeline_arguments(package, preset, by_section, raw_params)


def _describe_version(version: Any) -> str:
    return f"pipeline version {version.name} ({'uploaded' if version.uploaded else 'already on the server'})"


def submit(
    host: HostOpt,
    preset: PresetOpt = "tiny-cpu",
    corpus: CorpusOpt = "",
    qa: QaOpt = "",
    model_name: ModelNameOpt = "",
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
        data = {"corpus_uri": corpus, "qa_uri": qa, "model_name": model_name}
        pkg, arguments = _remote_arguments(host, package, preset, set_, param, data)
        from lmforge_kfp.pipelines.remote import Remote

        submitted = Remote(host, namespace, token=token).submit(
            pkg, arguments, experiment=experiment, run_name=run_name, service_account=service_account
        )
    except LmforgeError as exc:
        fail(exc)
    console.print(f"{_describe_version(submitted.version)}; experiment {experiment!r}", highlight=False, soft_wrap=True)
    console.print(f"run {submitted.run_name!r} created ({submitted.run_id})", highlight=False, soft_wrap=True)
    typer.echo(submitted.url)


def schedule(
    host: HostOpt,
    cron: Annotated[
        str,
        typer.Option("--cron", help="When to run: 5-field cron '0 3 * * 0' (Sundays 03:00) or KFP's 6-field form."),
    ],
    name: Annotated[str, typer.Option("--name", help="Recurring run name; an existing one is updated.")],
    preset: PresetOpt = "tiny-cpu",
    corpus: CorpusOpt = "",
    qa: QaOpt = "",
    model_name: ModelNameOpt = "",
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
        data = {"corpus_uri": corpus, "qa_uri": qa, "model_name": model_name}
        pkg, arguments = _remote_arguments(host, package, preset, set_, param, data)
        from lmforge_kfp.pipelines.remote import Remote, kfp_cron

        kfp_cron(cron)  # reject a bad expression before contacting the server
        if not name.strip():
            raise LmforgeError("--name: a recurring run needs a name")
        scheduled = Remote(host, namespace, token=token).schedule(
            pkg, arguments, name=name, cron=cron, experiment=experiment, service_account=service_account
        )
    except LmforgeError as exc:
        fail(exc)
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


def runs(
    host: Annotated[
        str,
        typer.Option(
            "--host",
            help="KFP API server URL, e.g. http://localhost:8080 (port-forward of ml-pipeline-ui); not with --mlflow.",
        ),
    ] = "",
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000, help="How many recent runs to show.")] = 20,
    experiment: Annotated[
        str, typer.Option("--experiment", help="Only runs of this experiment (with --mlflow: the MLflow experiment).")
    ] = "",
    namespace: NamespaceOpt = "",
    token: TokenOpt = None,
    mlflow: Annotated[
        bool,
        typer.Option(
            "--mlflow",
            help="Compare the last runs' key figures side by side from MLflow (the pipeline runs lmforge tracked) "
            "instead of listing the KFP server's runs.",
        ),
    ] = False,
    tracking_uri: Annotated[
        str | None,
        typer.Option("--tracking-uri", envvar="MLFLOW_TRACKING_URI", help="MLflow tracking server (with --mlflow)."),
    ] = None,
    verbose: VerboseOpt = False,
) -> None:
    """List the most recent runs on a Kubeflow Pipelines server with their state, or compare them from MLflow."""
    _setup_remote_logging(verbose)
    if mlflow:
        _mlflow_runs(tracking_uri, experiment, limit)
        return
    try:
        if not host:
            raise LmforgeError("--host: the KFP API server to list runs from (or --mlflow to compare them from MLflow)")
        from lmforge_kfp.pipelines.remote import Remote, check_host

        check_host(host)
        rows = Remote(host, namespace, token=token).list_runs(limit=limit, experiment=experiment)
    except LmforgeError as exc:
        fail(exc)
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


def _mlflow_runs(tracking_uri: str | None, experiment: str, limit: int) -> None:
    """The last ``limit`` pipeline runs tracked in MLflow, one column each (:func:`lmforge.tracking.compare_runs`)."""
    from lmforge.tracking.compare import compare_runs, side_by_side

    try:
        rows = compare_runs(tracking_uri, experiment or None, limit)
    except LmforgeError as exc:
        fail(exc)
    if not rows:
        console.print(f"no lmforge pipeline runs in MLflow experiment {experiment or '(default)'}", highlight=False)
        return
    table = Table(title="pipeline runs in MLflow" + (f" — experiment {experiment}" if experiment else ""))
    table.add_column("")
    for row in rows:
        table.add_column(str(row["run_id"])[:8], justify="right")
    for key, cells in side_by_side(rows):
        table.add_row(key, *cells)
    Console(width=max(Console().width, 40 + 24 * len(rows))).print(table)


def _when(moment: Any) -> str:
    return "—" if moment is None else f"{moment:%Y-%m-%d %H:%M}"
