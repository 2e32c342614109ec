"""Submit, schedule and list lmforge runs on a Kubeflow Pipelines API server (``lmforge submit|schedule|runs``).

Everything goes through the real ``kfp.Client``. The compiled pipeline is uploaded once per content: each
upload becomes a pipeline version named ``<package version>-<sha256 of the YAML, 12 hex>``, so the same YAML
is never uploaded twice and a changed YAML always gets a new version. KFP v2 cannot update a recurring run in
place, so :func:`schedule` creates the new recurring run first and only then deletes the old one(s) of that
name: a failed create leaves the old schedule untouched.

Every server call is wrapped so that an HTTP error or an unreachable host becomes a one-line
:class:`RemoteError` naming the host and the operation.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kfp
import kfp_server_api
import urllib3
import yaml

from lmforge import __version__
from lmforge.errors import LmforgeError
from lmforge.stages import sections

# The C loader when libyaml is there: a compiled pipeline is ~70 KB and pure-Python parsing is slow.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
log = logging.getLogger("lmforge.remote")

COMPILED_PIPELINE = Path(__file__).resolve().parent / "compiled" / "lmforge_pipeline.yaml"
DEFAULT_NAMESPACE = ""  # single-user KFP; multi-user: the Kubeflow profile namespace
DEFAULT_SERVICE_ACCOUNT = ""  # the server's default: pipeline-runner (single-user), default-editor (profiles)
TOKEN_ENV = "LMFORGE_KFP_TOKEN"
SA_TOKEN_ENV = "KF_PIPELINES_SA_TOKEN_PATH"  # kfp's own variable for a projected service-account token
AUTH_HINT = (
    f"the server wants an identity: pass --token (or ${TOKEN_ENV}), set ${SA_TOKEN_ENV} to a projected "
    "service-account token (audience pipelines.kubeflow.org), or go through the Kubeflow gateway"
)
DEFAULT_EXPERIMENT = "lmforge"
_PAGE_SIZE = 100


class RemoteError(LmforgeError):
    """The KFP API server refused a request or could not be reached."""


@dataclass(frozen=True)
class PipelinePackage:
    """A compiled pipeline YAML and what the server needs to know about it."""

    path: Path
    name: str
    inputs: dict[str, str]  # parameter name -> KFP parameterType (STRING, NUMBER_INTEGER, ...)
    sha256: str

    @property
    def version_name(self) -> str:
        """Pipeline version name: lmforge package version plus the first 12 hex of the YAML's sha256."""
        return f"{__version__}-{self.sha256[:12]}"


@dataclass(frozen=True)
class PipelineVersion:
    """A pipeline version on the server."""

    pipeline_id: str
    version_id: str
    name: str
    uploaded: bool  # False when this content was already on the server


@dataclass(frozen=True)
class Submitted:
    """What ``submit`` created."""

    run_id: str
    run_name: str
    url: str
    experiment_id: str
    version: PipelineVersion


@dataclass(frozen=True)
class Scheduled:
    """What ``schedule`` left on the server: exactly one recurring run named ``name``."""

    recurring_run_id: str
    name: str
    cron: str
    url: str
    version: PipelineVersion
    replaced: tuple[str, ...]  # ids of the recurring runs of this name that were deleted
    unchanged: bool  # the existing recurring run already matched; nothing was created or deleted


@dataclass(frozen=True)
class RunRow:
    """One run as ``lmforge runs`` shows it."""

    run_id: str
    name: str
    state: str
    created_at: datetime | None
    finished_at: datetime | None
    url: str


# ---------------------------------------------------------------------------------------------------------------
# Local validation: everything here runs before any request is sent.


def load_package(path: Path = COMPILED_PIPELINE) -> PipelinePackage:
    """Read a compiled pipeline YAML: its name, typed input parameters and content hash."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise LmforgeError(f"pipeline package {path}: {exc.strerror}; run `lmforge compile` first") from exc
    try:
        spec = next(yaml.load_all(data, Loader=_YAML_LOADER))
        name = spec["pipelineInfo"]["name"]
        parameters = spec.get("root", {}).get("inputDefinitions", {}).get("parameters", {})
    except (yaml.YAMLError, StopIteration, KeyError, TypeError, AttributeError) as exc:
        raise LmforgeError(f"pipeline package {path}: not a compiled KFP pipeline ({exc})") from exc
    inputs = {key: value.get("parameterType", "STRING") for key, value in parameters.items()}
    return PipelinePackage(path, name, inputs, hashlib.sha256(data).hexdigest())


def pipeline_arguments(
    package: PipelinePackage,
    preset: str,
    stage_overrides: dict[str, dict[str, Any]],
    params: dict[str, str],
) -> dict[str, Any]:
    """The run's parameters: the preset, one ``<stage>_overrides`` JSON per overridden stage, then ``--param``s.

    ``params`` holds raw ``--param`` text; each value is converted to the parameter's declared type. The preset
    and stage overrides have their own flags (``--preset``, ``--set``) because those are validated locally.
    """
    arguments: dict[str, Any] = {"preset": preset}
    arguments.update({f"{stage}_overrides": json.dumps(fields) for stage, fields in stage_overrides.items()})
    managed = {"preset", *(f"{section}_overrides" for section in sections())}
    for name, raw in params.items():
        if name in managed:
            flag = "--preset" if name == "preset" else f"--set {name.removesuffix('_overrides')}.FIELD=VALUE"
            raise LmforgeError(f"--param {name}: set it with {flag}, which is checked before submitting")
        if name not in package.inputs:
            known = ", ".join(sorted(set(package.inputs) - managed))
            raise LmforgeError(f"--param {name}: pipeline {package.name!r} has no such parameter; it has: {known}")
        arguments[name] = _typed_value(name, raw, package.inputs[name])
    missing = [name for name in arguments if name not in package.inputs]
    if missing:
        raise LmforgeError(f"pipeline package {package.path} has no parameter(s) {', '.join(missing)}; recompile it")
    return arguments


def _typed_value(name: str, raw: str, parameter_type: str) -> Any:
    """``raw`` as the KFP parameter type (STRING stays text, so ``1.10`` is not turned into ``1.1``)."""
    if parameter_type == "STRING":
        return raw
    if parameter_type == "BOOLEAN":
        if raw.lower() in ("true", "false"):
            return raw.lower() == "true"
        raise LmforgeError(f"--param {name}={raw}: expected true or false")
    try:
        if parameter_type == "NUMBER_INTEGER":
            return int(raw)
        if parameter_type == "NUMBER_DOUBLE":
            return float(raw)
        value = json.loads(raw)
    except ValueError as exc:
        raise LmforgeError(f"--param {name}={raw}: expected {parameter_type.lower()} ({exc})") from exc
    expected = {"STRUCT": dict, "LIST": list}.get(parameter_type)
    if expected is not None and not isinstance(value, expected):
        raise LmforgeError(f"--param {name}={raw}: expected a JSON {'object' if expected is dict else 'array'}")
    return value


def check_host(host: str) -> str:
    """``host`` without a trailing slash; it must name its scheme (kfp would otherwise assume https)."""
    if not host.startswith(("http://", "https://")):
        raise LmforgeError(f"--host {host!r}: expected a URL starting with http:// or https://")
    return host.rstrip("/")


def kfp_cron(expression: str) -> str:
    """A cron expression in the 6-field form KFP's scheduler expects (seconds first).

    KFP parses cron with a leading seconds field, so a standard 5-field ``0 3 * * 0`` (Sundays 03:00) would
    be misread; it is sent as ``0 0 3 * * 0``. Six fields are passed through unchanged.
    """
    fields = expression.split()
    if len(fields) == 5:
        return " ".join(["0", *fields])
    if len(fields) == 6:
        return " ".join(fields)
    raise LmforgeError(
        f"--cron {expression!r}: expected 5 fields (minute hour day month weekday) or 6 (seconds first, as KFP)"
    )


# ---------------------------------------------------------------------------------------------------------------
# Talking to the server.


def client_auth(token: str | None = None) -> dict[str, Any]:
    """``kfp.Client`` arguments that authenticate as KFP users do, first match wins.

    1. ``token`` (``--token``) or ``$LMFORGE_KFP_TOKEN``: sent as ``Authorization: Bearer`` (``existing_token``),
       e.g. ``kubectl create token <sa> --audience=pipelines.kubeflow.org`` against a multi-user server.
    2. ``$KF_PIPELINES_SA_TOKEN_PATH``: a projected service-account token file, re-read on every request
       (kfp's ``ServiceAccountTokenVolumeCredentials``), as inside a pod or a CI runner.
    3. Nothing: a port-forward of a single-user deployment, or a gateway URL that adds the identity itself.
    """
    token = token or os.environ.get(TOKEN_ENV)
    if token:
        return {"existing_token": token}
    path = os.environ.get(SA_TOKEN_ENV)
    if path:
        if not Path(path).is_file():
            raise RemoteError(f"${SA_TOKEN_ENV}={path}: no such token file")
        from kfp.client.set_volume_credentials import ServiceAccountTokenVolumeCredentials

        return {"credentials": ServiceAccountTokenVolumeCredentials(path)}
    return {}


class Remote:
    """A ``kfp.Client`` for one host and namespace, whose calls fail as one-line :class:`RemoteError`s."""

    def __init__(self, host: str, namespace: str = DEFAULT_NAMESPACE, *, token: str | None = None) -> None:
        self.host = check_host(host)
        self.namespace = namespace
        with self.call("connect"), warnings.catch_warnings():
            # kfp warns on every construction that it needs a v2 server; lmforge only talks to v2 servers.
            warnings.filterwarnings("ignore", category=FutureWarning, module="kfp")
            self.client = kfp.Client(host=self.host, namespace=namespace, **client_auth(token))

    @contextlib.contextmanager
    def call(self, operation: str) -> Iterator[None]:
        """Turn server failures inside the block into ``RemoteError("<host>: <operation> failed: ...")``.

        kfp prints UI links to stdout on some calls; they are logged at debug level instead so that the CLI
        decides what goes to stdout.
        """
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                yield
        except kfp_server_api.ApiException as exc:
            status = f"HTTP {exc.status} {exc.reason}".strip() if exc.status else str(exc.reason)
            detail = _server_message(exc.body)
            message = f"{self.host}: {operation} failed: {status}" + (f": {detail}" if detail else "")
            if exc.status == 401 or "no user identity header" in detail:
                message = f"{_one_line(message)}; {AUTH_HINT}"
                raise RemoteError(message) from exc
            raise RemoteError(_one_line(message)) from exc
        except urllib3.exceptions.HTTPError as exc:
            reason = exc.reason if isinstance(exc, urllib3.exceptions.MaxRetryError) else exc
            text = str(reason).split(">: ", 1)[-1]  # drop urllib3's "<HTTPConnection object at 0x...>: "
            raise RemoteError(_one_line(f"{self.host}: {operation} failed: cannot reach the server: {text}")) from exc
        except (ValueError, TimeoutError) as exc:  # kfp's own checks, e.g. two pipelines with one name
            raise RemoteError(_one_line(f"{self.host}: {operation} failed: {exc}")) from exc
        finally:
            for line in printed.getvalue().splitlines():
                log.debug("kfp: %s", line)

    def ui_url(self, kind: str, resource_id: str) -> str:
        """Link into the KFP UI served at the same host (``runs``, ``recurringrun``, ``experiments``, ...)."""
        return f"{self.host}/#/{kind}/details/{resource_id}"

    # -- pipelines ------------------------------------------------------------------------------------------------

    def ensure_pipeline_version(self, package: PipelinePackage) -> PipelineVersion:
        """The server's version of ``package``, uploading the pipeline and/or this version when missing."""
        name = package.version_name
        with self.call(f"find pipeline {package.name!r}"):
            pipeline_id = self.client.get_pipeline_id(package.name)
        if pipeline_id is None:
            with self.call(f"upload pipeline {package.name!r}"):
                pipeline_id = self.client.upload_pipeline(
                    str(package.path), pipeline_name=package.name, description=_description(package)
                ).pipeline_id
            log.info("uploaded pipeline %s (%s)", package.name, pipeline_id)
        with self.call(f"list versions of pipeline {package.name!r}"):
            existing = [
                v
                for v in _all_pages(
                    lambda token: self.client.list_pipeline_versions(
                        pipeline_id, page_token=token, page_size=_PAGE_SIZE, filter=_name_filter(name, "name")
                    ),
                    "pipeline_versions",
                )
                if name in (v.display_name, v.name)
            ]
        if existing:
            return PipelineVersion(pipeline_id, existing[0].pipeline_version_id, name, uploaded=False)
        with self.call(f"upload version {name!r} of pipeline {package.name!r}"):
            version = self.client.upload_pipeline_version(
                str(package.path), name, pipeline_id=pipeline_id, description=_description(package)
            )
        log.info("uploaded pipeline version %s (%s)", name, version.pipeline_version_id)
        return PipelineVersion(pipeline_id, version.pipeline_version_id, name, uploaded=True)

    # -- experiments ----------------------------------------------------------------------------------------------

    def ensure_experiment(self, name: str) -> str:
        """The id of experiment ``name`` in this namespace, created when missing."""
        with self.call(f"get or create experiment {name!r}"):
            return self.client.create_experiment(name, namespace=self.namespace or None).experiment_id

    def experiment_id(self, name: str) -> str:
        """The id of an existing experiment ``name``."""
        with self.call(f"find experiment {name!r}"):
            return self.client.get_experiment(experiment_name=name, namespace=self.namespace or None).experiment_id

    # -- runs -----------------------------------------------------------------------------------------------------

    def submit(
        self,
        package: PipelinePackage,
        arguments: dict[str, Any],
        *,
        experiment: str = DEFAULT_EXPERIMENT,
        run_name: str = "",
        service_account: str = DEFAULT_SERVICE_ACCOUNT,
    ) -> Submitted:
        """Upload ``package`` (if new), get or create ``experiment`` and start one run of it."""
        version = self.ensure_pipeline_version(package)
        experiment_id = self.ensure_experiment(experiment)
        run_name = run_name or f"{package.name} {version.name} {datetime.now(UTC):%Y-%m-%d %H:%M:%S}"
        with self.call(f"create run {run_name!r}"):
            run = self.client.run_pipeline(
                experiment_id,
                run_name,
                params=arguments,
                pipeline_id=version.pipeline_id,
                version_id=version.version_id,
                service_account=service_account or None,
            )
        return Submitted(run.run_id, run_name, self.ui_url("runs", run.run_id), experiment_id, version)

    def list_runs(self, limit: int = 20, experiment: str = "") -> list[RunRow]:
        """The ``limit`` most recent runs (of ``experiment`` when given), newest first."""
        experiment_id = self.experiment_id(experiment) if experiment else None
        with self.call("list runs"):
            response = self.client.list_runs(
                page_size=limit,
                sort_by="created_at desc",
                experiment_id=experiment_id,
                namespace=self.namespace or None,
            )
        return [
            RunRow(
                run.run_id,
                run.display_name or "",
                run.state or "UNKNOWN",
                run.created_at,
                run.finished_at,
                self.ui_url("runs", run.run_id),
            )
            for run in (response.runs or [])[:limit]
        ]

    # -- recurring runs -------------------------------------------------------------------------------------------

    def recurring_runs_named(self, name: str) -> list[Any]:
        """Every recurring run called ``name`` in this namespace (all pages; the name is checked here too)."""
        with self.call(f"list recurring runs named {name!r}"):
            return [
                r
                for r in _all_pages(
                    lambda token: self.client.list_recurring_runs(
                        page_token=token,
                        page_size=_PAGE_SIZE,
                        namespace=self.namespace or None,
                        filter=_name_filter(name),
                    ),
                    "recurring_runs",
                )
                if r.display_name == name
            ]

    def schedule(
        self,
        package: PipelinePackage,
        arguments: dict[str, Any],
        *,
        name: str,
        cron: str,
        experiment: str = DEFAULT_EXPERIMENT,
        service_account: str = DEFAULT_SERVICE_ACCOUNT,
    ) -> Scheduled:
        """Create or update the recurring run ``name`` so that it runs this package's version on ``cron``.

        Idempotent: when exactly one recurring run of that name already runs the same version with the same
        schedule, parameters and service account, nothing changes. Otherwise the new recurring run is created
        first and every older one of that name is deleted after it, so a failure never leaves the name without
        a schedule, and a success leaves exactly one.
        """
        cron = kfp_cron(cron)
        version = self.ensure_pipeline_version(package)
        experiment_id = self.ensure_experiment(experiment)
        existing = self.recurring_runs_named(name)
        wanted = {
            "enabled": True,
            "version_id": version.version_id,
            "cron": cron,
            "parameters": arguments,
            "service_account": service_account or "",
            "experiment_id": experiment_id,
        }
        if len(existing) == 1 and _recurring_run_settings(existing[0]) == wanted:
            current = existing[0].recurring_run_id
            return Scheduled(current, name, cron, self.ui_url("recurringrun", current), version, (), unchanged=True)
        with self.call(f"create recurring run {name!r}"):
            created = self.client.create_recurring_run(
                experiment_id,
                name,
                description=f"lmforge {package.name} {version.name}, scheduled by `lmforge schedule`",
                cron_expression=cron,
                max_concurrency=1,  # a retraining run never overlaps the previous one
                no_catchup=True,  # after a pause, run once, not once per missed slot
                params=arguments,
                pipeline_id=version.pipeline_id,
                version_id=version.version_id,
                service_account=service_account or None,
            )
        new_id = created.recurring_run_id
        failed: list[str] = []
        for old in existing:
            try:
                with self.call(f"delete recurring run {old.recurring_run_id}"):
                    self.client.delete_recurring_run(old.recurring_run_id)
            except RemoteError as exc:
                log.error("%s", exc)
                failed.append(old.recurring_run_id)
        if failed:
            raise RemoteError(
                f"{self.host}: recurring run {name!r} was created as {new_id} on version {version.name}, but the old "
                f"one(s) {', '.join(failed)} could not be deleted; delete them so that only {new_id} remains"
            )
        replaced = tuple(old.recurring_run_id for old in existing)
        return Scheduled(new_id, name, cron, self.ui_url("recurringrun", new_id), version, replaced, unchanged=False)


def _recurring_run_settings(recurring_run: Any) -> dict[str, Any]:
    """The fields :meth:`Remote.schedule` compares to decide whether an update is needed."""
    reference = recurring_run.pipeline_version_reference
    trigger = recurring_run.trigger
    return {
        "enabled": recurring_run.status != "DISABLED" and recurring_run.mode != "DISABLE",
        "version_id": reference.pipeline_version_id if reference else recurring_run.pipeline_version_id,
        "cron": trigger.cron_schedule.cron if trigger and trigger.cron_schedule else None,
        "parameters": (recurring_run.runtime_config.parameters or {}) if recurring_run.runtime_config else {},
        "service_account": recurring_run.service_account or "",
        "experiment_id": recurring_run.experiment_id,
    }


def _all_pages(fetch: Callable[[str], Any], field: str) -> Iterator[Any]:
    """Items of list field ``field`` across every page of a paginated KFP list call."""
    token = ""
    while True:
        response = fetch(token)
        yield from getattr(response, field) or []
        token = response.next_page_token or ""
        if not token:
            return


def _name_filter(name: str, key: str = "display_name") -> str:
    """A KFP list filter: ``<key> == name``."""
    return json.dumps({"predicates": [{"operation": "EQUALS", "key": key, "stringValue": name}]})


def _description(package: PipelinePackage) -> str:
    return f"lmforge {__version__}, {package.path.name} sha256 {package.sha256}"


def _server_message(body: Any) -> str:
    """The human part of a KFP error body (grpc-gateway JSON ``{"error"|"message": ...}``), else the raw text."""
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if not body:
        return ""
    try:
        parsed = json.loads(body)
    except (TypeError, ValueError):
        return str(body)
    if isinstance(parsed, dict):
        return str(parsed.get("message") or parsed.get("error") or parsed)
    return str(parsed)


def _one_line(text: str, limit: int = 400) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"
