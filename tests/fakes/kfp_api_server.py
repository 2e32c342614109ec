"""A stand-in for the Kubeflow Pipelines v2beta1 REST API on loopback, for tests of ``lmforge submit|schedule|runs``.

No real KFP API server can run here, so this implements just the endpoints that ``kfp.Client`` (kfp 2.x,
``kfp_server_api``) calls for those commands, with the paths, query parameters and JSON field names of the
generated client: healthz; pipelines list/get/upload/upload_version and their versions; experiments
create/list/get; runs create/list/get; recurring runs create/list/get/delete/enable/disable. State is in
memory, every request is recorded, and :meth:`KfpApiServer.fail_with` makes matching requests fail with a
chosen HTTP status in the grpc-gateway error shape the real server uses.

Checks the real server also makes are mirrored where the tests rely on them: unknown experiment or pipeline
version → 404, a pipeline or version name used twice → 409, run parameters the pipeline does not declare →
400, and a cron expression without KFP's leading seconds field (6 fields) → 400.

The server binds 127.0.0.1 on a free port, serves from one daemon thread, answers at most ``max_requests``
requests, and shuts itself down after ``lifetime_s`` even if a test never stops it.
"""

from __future__ import annotations

import email.parser
import email.policy
import itertools
import json
import re
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import HTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

from tests.fakes.json_handler import JsonHandler

# The C loader when libyaml is there: a compiled pipeline is ~70 KB and pure-Python parsing is slow.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
API = "/apis/v2beta1"
_EPOCH = datetime(2025, 1, 1, tzinfo=UTC)
_GRPC_CODE = {400: 3, 401: 16, 404: 5, 409: 6, 413: 8, 429: 8, 500: 13, 503: 14}


class ApiError(Exception):
    """An HTTP error answer: status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Recorded:
    """One request as the server saw it."""

    method: str
    path: str
    query: dict[str, str]
    body: Any  # parsed JSON; for uploads the multipart fields ({"uploadfile": bytes}); None when empty


@dataclass
class _Failure:
    status: int
    method: str | None
    path: str | None


@dataclass
class KfpApiServer:
    """In-memory KFP v2beta1 API on ``http://127.0.0.1:<port>``; use as a context manager."""

    multi_user: bool = False
    token: str | None = None  # multi-user: the bearer token the (TokenReview) authenticator accepts
    lifetime_s: float = 120.0
    max_requests: int = 2000
    max_body_bytes: int = 16 * 1024 * 1024
    requests: list[Recorded] = field(default_factory=list)
    pipelines: dict[str, dict[str, Any]] = field(default_factory=dict)
    versions: dict[str, dict[str, Any]] = field(default_factory=dict)
    specs: dict[str, dict[str, Any]] = field(default_factory=dict)  # version id -> pipeline spec
    experiments: dict[str, dict[str, Any]] = field(default_factory=dict)
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    recurring_runs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._failure: _Failure | None = None
        self._httpd: HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._timer: threading.Timer | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL to pass as ``--host``."""
        assert self._httpd is not None, "server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> KfpApiServer:
        handler = type("Handler", (_Handler,), {"api": self})
        self._httpd = HTTPServer(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kfp-api-server", daemon=True)
        self._thread.start()
        self._timer = threading.Timer(self.lifetime_s, self.stop)
        self._timer.daemon = True
        self._timer.start()
        return self

    def stop(self) -> None:
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.cancel()
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def __enter__(self) -> KfpApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- test controls -----------------------------------------------------------------------------------------------

    def fail_with(self, status: int, method: str | None = None, path: str | None = None) -> None:
        """Answer every request matching ``method`` and path prefix ``path`` (None: any) with ``status``."""
        self._failure = _Failure(status, method, path)

    def clear_failure(self) -> None:
        self._failure = None

    def calls(self, method: str, path: str) -> list[Recorded]:
        """Recorded requests with this method and path ``API + path``."""
        return [r for r in self.requests if r.method == method and r.path == API + path]

    def recurring_runs_named(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.recurring_runs.values() if r["display_name"] == name]

    # -- request handling --------------------------------------------------------------------------------------------

    def handle(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        with self._lock:
            if len(self.requests) >= self.max_requests:
                raise ApiError(429, f"stand-in KFP server: more than {self.max_requests} requests")
            self.requests.append(Recorded(method, path, query, body))
            failure = self._failure
            if failure and (failure.method in (None, method)) and path.startswith(failure.path or ""):
                raise ApiError(failure.status, f"injected failure for {method} {path}")
            for route_method, pattern, action in _ROUTES:
                match = re.fullmatch(API + pattern, path)
                if match and route_method == method:
                    return 200, action(self, query, body, *match.groups())
            raise ApiError(404, f"stand-in KFP server: no route for {method} {path}")

    def _new_id(self, kind: str) -> str:
        return f"{kind}-{next(self._ids):04d}"

    def _now(self) -> str:
        # A clock that ticks one second per created object: ordering is deterministic, not timing-dependent.
        return (_EPOCH + timedelta(seconds=len(self.requests))).strftime("%Y-%m-%dT%H:%M:%SZ")

    def _namespace_ok(self, item: dict[str, Any], query: dict[str, str]) -> bool:
        return not self.multi_user or item.get("namespace", "") == query.get("namespace", "")

    # pipelines ----------------------------------------------------------------------------------------------

    def list_pipelines(self, query: dict[str, str], body: Any) -> dict[str, Any]:
        return _page(query, "pipelines", list(self.pipelines.values()))

    def get_pipeline(self, query: dict[str, str], body: Any, pipeline_id: str) -> dict[str, Any]:
        return _get(self.pipelines, pipeline_id, "pipeline")

    def upload_pipeline(self, query: dict[str, str], body: Any) -> dict[str, Any]:
        spec = _spec_of(body)
        name = query.get("name") or query.get("display_name") or spec["pipelineInfo"]["name"]
        if any(p["name"] == name for p in self.pipelines.values()):
            raise ApiError(409, f"pipeline name {name!r} already exists")
        pipeline = {
            "pipeline_id": self._new_id("pipeline"),
            "name": name,
            "display_name": query.get("display_name") or name,
            "description": query.get("description", ""),
            "namespace": query.get("namespace", ""),
            "created_at": self._now(),
        }
        self.pipelines[pipeline["pipeline_id"]] = pipeline
        # Like the real server, an upload also creates the pipeline's first version, named like the pipeline.
        self._add_version(pipeline["pipeline_id"], name, pipeline["description"], spec)
        return pipeline

    def upload_pipeline_version(self, query: dict[str, str], body: Any) -> dict[str, Any]:
        pipeline_id = query.get("pipelineid", "")
        _get(self.pipelines, pipeline_id, "pipeline")
        name = query.get("name") or query.get("display_name") or ""
        if not name:
            raise ApiError(400, "pipeline version name is empty")
        if any(v["pipeline_id"] == pipeline_id and v["name"] == name for v in self.versions.values()):
            raise ApiError(409, f"pipeline version name {name!r} already exists in pipeline {pipeline_id}")
        return self._add_version(pipeline_id, name, query.get("description", ""), _spec_of(body))

    def _add_version(self, pipeline_id: str, name: str, description: str, spec: dict[str, Any]) -> dict[str, Any]:
        version = {
            "pipeline_id": pipeline_id,
            "pipeline_version_id": self._new_id("version"),
            "name": name,
            "display_name": name,
            "description": description,
            "created_at": self._now(),
        }
        self.versions[version["pipeline_version_id"]] = version
        self.specs[version["pipeline_version_id"]] = spec
        return version

    def list_versions(self, query: dict[str, str], body: Any, pipeline_id: str) -> dict[str, Any]:
        _get(self.pipelines, pipeline_id, "pipeline")
        mine = [v for v in self.versions.values() if v["pipeline_id"] == pipeline_id]
        return _page(query, "pipeline_versions", mine)

    def get_version(self, query: dict[str, str], body: Any, pipeline_id: str, version_id: str) -> dict[str, Any]:
        version = _get(self.versions, version_id, "pipeline version")
        if version["pipeline_id"] != pipeline_id:
            raise ApiError(404, f"pipeline version {version_id} is not in pipeline {pipeline_id}")
        return version

    # experiments ----------------------------------------------------------------------------------------------

    def list_experiments(self, query: dict[str, str], body: Any) -> dict[str, Any]:
        visible = [e for e in self.experiments.values() if self._namespace_ok(e, query)]
        return _page(query, "experiments", visible)

    def create_experiment(self, query: dict[str, str], body: Any) -> dict[str, Any]:
        name = body.get("display_name", "")
        namespace = body.get("namespace", "") if self.multi_user else ""
        if self.multi_user and not namespace:
            raise ApiError(400, "multi-user mode: an experiment needs a namespace")
        if any(e["display_name"] == name and e["namespace"] == namespace for e in self.experiments.values()):
            raise ApiError(409, f"experiment {name!r} already exists")
        experiment = {
            "experiment_id": self._new_id("experiment"),
            "display_name": name,
            "description": body.get("description", ""),
            "namespace": namespace,
            "created_at": self._now(),
            "storage_state": "AVAILABLE",
        }
        self.experiments[experiment["experiment_id"]] = experiment
        return experiment

    def get_experiment(self, query: dict[str, str], body: Any, experiment_id: str) -> dict[str, Any]:
        return _get(self.experiments, experiment_id, "experiment")

    # runs and recurring runs ------------------------------------------------------------------------------------------

    def _checked_source(self, body: dict[str, Any]) -> dict[str, Any]:
        """Check experiment, pipeline version and parameters of a run or recurring run; return its experiment."""
        experiment = _get(self.experiments, body.get("experiment_id", ""), "experiment")
        reference = body.get("pipeline_version_reference") or {}
        version = _get(self.versions, reference.get("pipeline_version_id", ""), "pipeline version")
        if version["pipeline_id"] != reference.get("pipeline_id"):
            raise ApiError(400, "pipeline_version_reference: version does not belong to the pipeline")
        declared = self.specs[version["pipeline_version_id"]].get("root", {}).get("inputDefinitions", {})
        unknown = set((body.get("runtime_config") or {}).get("parameters") or {}) - set(declared.get("parameters", {}))
        if unknown:
            raise ApiError(400, f"unknown pipeline parameters: {', '.join(sorted(unknown))}")
        return experiment

    def create_run(self, query: dict[str, str], body: Any) -> dict[str, Any]:
        experiment = self._checked_source(body)
        run = {
            **body,
            "run_id": self._new_id("run"),
            "created_at": self._now(),
            "state": "PENDING",
            "storage_state": "AVAILABLE",
            "namespace": experiment["namespace"],
        }
        self.runs[run["run_id"]] = run
        return _public_run(run)

    def list_runs(self, query: dict[str, str], body: Any) -> dict[str, Any]:
        visible = [
            r
            for r in self.runs.values()
            if self._namespace_ok(r, query) and query.get("experiment_id") in (None, r["experiment_id"])
        ]
        return _page(query, "runs", [_public_run(r) for r in visible])

    def get_run(self, query: dict[str, str], body: Any, run_id: str) -> dict[str, Any]:
        return _public_run(_get(self.runs, run_id, "run"))

    def create_recurring_run(self, query: dict[str, str], body: Any) -> dict[str, Any]:
        experiment = self._checked_source(body)
        cron = ((body.get("trigger") or {}).get("cron_schedule") or {}).get("cron", "")
        if len(cron.split()) != 6:
            raise ApiError(400, f"cron {cron!r}: KFP expects 6 fields, seconds first")
        recurring_run = {
            **body,
            "recurring_run_id": self._new_id("recurring"),
            "created_at": self._now(),
            "updated_at": self._now(),
            "status": "DISABLED" if body.get("mode") == "DISABLE" else "ENABLED",
            "namespace": experiment["namespace"],
        }
        self.recurring_runs[recurring_run["recurring_run_id"]] = recurring_run
        return recurring_run

    def list_recurring_runs(self, query: dict[str, str], body: Any) -> dict[str, Any]:
        visible = [
            r
            for r in self.recurring_runs.values()
            if self._namespace_ok(r, query) and query.get("experiment_id") in (None, r["experiment_id"])
        ]
        # kfp_server_api maps this one list field as camelCase: V2beta1ListRecurringRunsResponse.recurring_runs.
        return _page(query, "recurringRuns", visible)

    def get_recurring_run(self, query: dict[str, str], body: Any, recurring_run_id: str) -> dict[str, Any]:
        return _get(self.recurring_runs, recurring_run_id, "recurring run")

    def delete_recurring_run(self, query: dict[str, str], body: Any, recurring_run_id: str) -> dict[str, Any]:
        _get(self.recurring_runs, recurring_run_id, "recurring run")
        del self.recurring_runs[recurring_run_id]
        return {}

    def set_recurring_run_mode(self, query: dict[str, str], body: Any, recurring_run_id: str, verb: str) -> dict:
        recurring_run = _get(self.recurring_runs, recurring_run_id, "recurring run")
        recurring_run["mode"] = "ENABLE" if verb == "enable" else "DISABLE"
        recurring_run["status"] = "ENABLED" if verb == "enable" else "DISABLED"
        recurring_run["updated_at"] = self._now()
        return {}

    def healthz(self, query: dict[str, str], body: Any) -> dict[str, Any]:
        return {"multi_user": self.multi_user, "pipeline_store": "database"}


_ID = r"([\w.-]+)"
_ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "/healthz", KfpApiServer.healthz),
    ("GET", "/pipelines", KfpApiServer.list_pipelines),
    ("POST", "/pipelines/upload", KfpApiServer.upload_pipeline),
    ("POST", "/pipelines/upload_version", KfpApiServer.upload_pipeline_version),
    ("GET", f"/pipelines/{_ID}", KfpApiServer.get_pipeline),
    ("GET", f"/pipelines/{_ID}/versions", KfpApiServer.list_versions),
    ("GET", f"/pipelines/{_ID}/versions/{_ID}", KfpApiServer.get_version),
    ("GET", "/experiments", KfpApiServer.list_experiments),
    ("POST", "/experiments", KfpApiServer.create_experiment),
    ("GET", f"/experiments/{_ID}", KfpApiServer.get_experiment),
    ("GET", "/runs", KfpApiServer.list_runs),
    ("POST", "/runs", KfpApiServer.create_run),
    ("GET", f"/runs/{_ID}", KfpApiServer.get_run),
    ("GET", "/recurringruns", KfpApiServer.list_recurring_runs),
    ("POST", "/recurringruns", KfpApiServer.create_recurring_run),
    ("GET", f"/recurringruns/{_ID}", KfpApiServer.get_recurring_run),
    ("DELETE", f"/recurringruns/{_ID}", KfpApiServer.delete_recurring_run),
    ("POST", f"/recurringruns/{_ID}:(enable|disable)", KfpApiServer.set_recurring_run_mode),
]


def _get(table: dict[str, dict[str, Any]], key: str, what: str) -> dict[str, Any]:
    if key not in table:
        raise ApiError(404, f"{what} {key!r} not found")
    return table[key]


def _public_run(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k != "namespace"}


def _matches(item: dict[str, Any], predicate: dict[str, Any]) -> bool:
    operation = predicate.get("operation")
    if operation not in ("EQUALS", 1):
        raise ApiError(400, f"stand-in KFP server: filter operation {operation!r} not implemented")
    value = predicate.get("stringValue", predicate.get("string_value"))
    return item.get(predicate.get("key", "")) == value


def _page(query: dict[str, str], field_name: str, items: list[dict[str, Any]]) -> dict[str, Any]:
    """Filter (EQUALS predicates), sort (``created_at [desc]``) and paginate like the real list endpoints."""
    if query.get("filter"):
        predicates = json.loads(query["filter"]).get("predicates", [])
        items = [item for item in items if all(_matches(item, p) for p in predicates)]
    sort_by = query.get("sort_by", "")
    if sort_by:
        key, _, order = sort_by.partition(" ")
        items = sorted(items, key=lambda item: str(item.get(key, "")), reverse=order == "desc")
    start = int(query.get("page_token") or 0)
    size = int(query.get("page_size") or 20)
    page = items[start : start + size]
    next_token = str(start + size) if start + size < len(items) else ""
    return {field_name: page, "total_size": len(items), "next_page_token": next_token}


def _spec_of(body: Any) -> dict[str, Any]:
    try:
        spec = next(yaml.load_all(body["uploadfile"], Loader=_YAML_LOADER))
        spec["pipelineInfo"]["name"]
    except (yaml.YAMLError, StopIteration, KeyError, TypeError) as exc:
        raise ApiError(400, f"invalid pipeline package: {exc}") from exc
    return spec


class _Handler(JsonHandler):
    api: KfpApiServer

    def _serve(self) -> None:
        parts = urlsplit(self.path)
        query = {key: values[-1] for key, values in parse_qs(parts.query, keep_blank_values=True).items()}
        try:
            body = self._body()
            self._authenticate()
            status, payload = self.api.handle(self.command, parts.path, query, body)
        except ApiError as exc:
            status = exc.status
            payload = {"error": exc.message, "code": _GRPC_CODE.get(status, 2), "message": exc.message, "details": []}
        self.send_json(status, payload)

    def _authenticate(self) -> None:
        """Multi-user mode: an identity header (``kubeflow-userid``, set by the Kubeflow gateway) or a bearer token.

        Copied rule and message: kubeflow/pipelines ``backend/src/apiserver/auth/authenticator.go``
        (``IdentityHeaderMissingError``, an Unauthenticated error, HTTP 401) at release 2.17.0.
        """
        if self.api.token is None or self.path.startswith(f"{API}/healthz"):
            return
        if self.headers.get("kubeflow-userid") or self.headers.get("Authorization") == f"Bearer {self.api.token}":
            return
        raise ApiError(401, "Request header error: there is no user identity header.")

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        if length > self.api.max_body_bytes:
            raise ApiError(413, f"request body over {self.api.max_body_bytes} bytes")
        raw = self.rfile.read(length) if length else b""
        content_type = self.headers.get("Content-Type", "")
        if content_type.startswith("multipart/form-data"):
            message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
                f"Content-Type: {content_type}\r\n\r\n".encode() + raw
            )
            return {
                part.get_param("name", header="content-disposition"): part.get_payload(decode=True)
                for part in message.iter_parts()
            }
        if raw:
            try:
                return json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ApiError(400, f"request body is not JSON: {exc}") from exc
        return None

    do_GET = do_POST = do_DELETE = do_PATCH = _serve
