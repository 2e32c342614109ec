"""A small Kubernetes-API-shaped HTTP server on loopback, for testing ``lmforge.launch`` without a cluster.

It implements only what the launcher calls, with the real paths, query parameters and JSON shapes:

- custom objects of ``trainer.kubeflow.org/v1alpha1`` trainjobs and ``kubeflow.org/v1`` pytorchjobs:
  create (POST, 409 on a duplicate), get (404 when absent), list, watch (``?watch=true`` with
  ``fieldSelector=metadata.name=``, ``resourceVersion``, ``timeoutSeconds``; newline-delimited events;
  an ``ERROR`` event with code 410 on request), delete (with the options body);
- ``/api/v1/namespaces/{ns}/pods`` (``labelSelector`` with ``k=v`` terms) and ``.../pods/{name}/log``
  (``container``, ``follow``, ``tailLines``; 400 while the pod is Pending).

- API discovery ``/apis/{group}/{version}`` (an ``APIResourceList``; 404 for a job kind not ``served``);
- the OpenAPI v3 document ``/openapi/v3/apis/{group}/{version}``, built from the CRD of the chosen Kubeflow
  Trainer release (``trainer_version``: ``v2.1.0`` has ``spec.podTemplateOverrides``, ``v2.3.0``
  ``spec.runtimePatches``), and the API server's unknown-field rule on create (tests/support/crd_schema.py): with
  ``fieldValidation=Strict`` an undeclared field is a 400, otherwise it is pruned (and listed in ``pruned``);
- with ``runtimes`` (the names of the (Cluster)TrainingRuntimes the cluster has), Trainer's validating webhook on a
  TrainJob create: one naming another runtime is a 403 with the message the webhook and the API server give
  (``pkg/runtime/core/clustertrainingruntime.go`` and ``trainingruntime.go`` ``ValidateObjects`` in
  kubeflow/trainer v2.1.0 and v2.3.0; controller-runtime's ``Denied`` answers 403; the API server prefixes
  ``admission webhook "<name>" denied the request: ``).

A job moves through a *script*: a list of :class:`Step`, each setting the job's status conditions and its
pods. Steps advance only while a watch on the job is open and has delivered every earlier event, so a
client sees each state in order and no test depends on timing. Every request is recorded.

With ``execute=True`` a created job that has no script *runs* instead, as the operator and kubelets would:
one local process per node (``torchrun`` → ``python -m torch.distributed.run`` with the ``PET_*`` env Trainer
and the Training Operator set: nodes, procs per node, node rank, master address and port), with the
manifest's env (``secretKeyRef`` entries resolved from ``secrets``, as the kubelet does) over a small base
env, and its own ``TMPDIR`` (pods share no disk). Pod logs fill as the processes print and ``follow=true``
streams them; the job turns Complete/Succeeded when every pod exits 0, else Failed. Deleting the job kills
its processes.

The server binds 127.0.0.1 on a free port, serves from daemon threads and shuts itself down after
``max_lifetime_s`` if a test forgets to; use it as a context manager. Point a client at it with::

    cfg = kubernetes.client.Configuration(); cfg.host = server.url
    api = kubernetes.client.ApiClient(cfg)
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.fakes.json_handler import JsonHandler
from tests.support.crd_schema import CRDS, TRAINER_CRDS, crd_schema, unknown_fields

PYTORCHJOB_CRD = CRDS / "kubeflow.org_pytorchjobs.yaml"
KINDS = {  # (group, version, plural) -> (kind, pod label the operator sets, container name)
    ("trainer.kubeflow.org", "v1alpha1", "trainjobs"): ("TrainJob", "jobset.sigs.k8s.io/jobset-name", "node"),
    ("kubeflow.org", "v1", "pytorchjobs"): ("PyTorchJob", "training.kubeflow.org/job-name", "pytorch"),
}


@dataclass
class Pod:
    """A pod of a job: its phase and the lines its training container logged."""

    name: str
    phase: str = "Running"
    log: list[str] = field(default_factory=list)
    live: bool = False  # a process is writing the log: `follow` streams it until the process ends


@dataclass
class Step:
    """One state of a job: status conditions (type → (status, reason, message)), pods, and a hook."""

    conditions: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    pods: list[Pod] | None = None  # None: keep the pods as they are
    on_enter: Callable[[], None] | None = None  # runs (in the server thread) after the step is applied


def nodes_and_procs(job: Mapping[str, Any]) -> tuple[int, int]:
    """``(nodes, processes per node)`` the operator starts for a TrainJob (``numNodes``, ``numProcPerNode``) or a
    PyTorchJob (the Master and its Workers, ``nprocPerNode``)."""
    spec = job["spec"]
    if job["kind"] == "TrainJob":
        return spec["trainer"].get("numNodes", 1), spec["trainer"].get("numProcPerNode", 1)
    workers = spec["pytorchReplicaSpecs"].get("Worker", {}).get("replicas", 0)
    return 1 + workers, int(spec.get("nprocPerNode", 1))


def created(kind: str) -> Step:
    if kind == "TrainJob":
        return Step({"Created": ("True", "JobsCreationSucceeded", "Succeeded to create Jobs")})
    return Step({"Created": ("True", "PyTorchJobCreated", "PyTorchJob is created.")})


def running(kind: str, pods: list[Pod], on_enter: Callable[[], None] | None = None) -> Step:
    if kind == "TrainJob":  # Trainer v2 has no Running condition; the JobSet's jobs are active
        return Step({}, pods, on_enter)
    return Step({"Running": ("True", "PyTorchJobRunning", "PyTorchJob is running.")}, pods, on_enter)


def succeeded(kind: str, pods: list[Pod] | None = None) -> Step:
    if kind == "TrainJob":
        return Step({"Complete": ("True", "JobSetCompleted", "jobset completed successfully")}, pods)
    return Step(
        {"Running": ("False", "PyTorchJobSucceeded", ""), "Succeeded": ("True", "PyTorchJobSucceeded", "done")}, pods
    )


def failed(kind: str, message: str, pods: list[Pod] | None = None) -> Step:
    if kind == "TrainJob":
        return Step({"Failed": ("True", "JobSetFailed", message)}, pods)
    return Step({"Running": ("False", "PyTorchJobFailed", ""), "Failed": ("True", "PyTorchJobFailed", message)}, pods)


@dataclass
class _Job:
    obj: dict[str, Any]
    plural: str
    script: list[Step]
    pods: list[Pod] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)


class K8sApiServer:
    """The fake API server: jobs, their scripts, pods, watch events and the request record."""

    def __init__(
        self,
        *,
        max_lifetime_s: float = 60.0,
        execute: bool = False,
        workdir: Path | None = None,
        secrets: Mapping[str, Mapping[str, str]] | None = None,
        base_env: Mapping[str, str] | None = None,
        served: tuple[str, ...] = ("TrainJob", "PyTorchJob"),
        trainer_version: str = "v2.3.0",
        runtimes: Collection[str] | None = None,
    ) -> None:
        self.requests: list[dict[str, Any]] = []
        self.execute = execute
        self.workdir = workdir
        self.secrets = {name: dict(data) for name, data in (secrets or {}).items()}
        self.base_env = dict(base_env or {})
        self.served = served
        self.runtimes = None if runtimes is None else set(runtimes)  # None: every runtime a TrainJob names exists
        self.schemas = {  # kind -> the openAPIV3Schema the server enforces
            "TrainJob": crd_schema(TRAINER_CRDS[trainer_version], "v1alpha1"),
            "PyTorchJob": crd_schema(PYTORCHJOB_CRD, "v1"),
        }
        self.pruned: list[str] = []  # fields dropped from created objects (no strict validation asked for)
        self.pod_envs: dict[str, dict[str, str]] = {}  # pod name -> the env its process got (execute mode)
        self._jobs: dict[tuple[str, str, str], _Job] = {}  # (plural, namespace, name)
        self._scripts: dict[str, list[Step]] = {}
        self._events: list[tuple[int, str, tuple[str, str, str], dict[str, Any]]] = []
        self._rv = itertools.count(1000)
        self._lock = threading.Condition()
        self._gone_once: set[str] = set()
        self._close_after: dict[str, int] = {}
        self._stopping = threading.Event()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._timer = threading.Timer(max_lifetime_s, self.stop)
        self._timer.daemon = True

    # --- lifecycle -----------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def start(self) -> K8sApiServer:
        self._thread.start()
        self._timer.start()
        return self

    def stop(self) -> None:
        self._timer.cancel()
        self._stopping.set()
        with self._lock:
            procs = [proc for job in self._jobs.values() for proc in job.procs]
        for proc in procs:
            _kill(proc)
        with self._lock:
            self._lock.notify_all()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> K8sApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- scripting -----------------------------------------------------------------------------------------
    def script(self, name: str, steps: list[Step]) -> None:
        """Steps the job called ``name`` goes through once it is created."""
        self._scripts[name] = list(steps)

    def seed(self, manifest: dict[str, Any], steps: list[Step]) -> None:
        """A job that already exists (an earlier attempt created it), with its first step applied."""
        with self._lock:
            job = self._store(manifest, list(steps))
            self._advance(job)

    def expire_next_watch(self, name: str) -> None:
        """The next watch of ``name`` gets an ERROR event 410 Gone (its resourceVersion is too old)."""
        self._gone_once.add(name)

    def close_watch_after(self, name: str, events: int) -> None:
        """Each watch of ``name`` ends after delivering this many events (as a server-side timeout would)."""
        self._close_after[name] = events

    def remove(self, plural: str, namespace: str, name: str) -> None:
        """Delete a job behind the client's back (as a person with kubectl would)."""
        with self._lock:
            job = self._jobs.pop((plural, namespace, name))
            job.obj["metadata"]["resourceVersion"] = str(next(self._rv))
            self._event("DELETED", (plural, namespace, name), job.obj)

    def job(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            job = self._jobs.get((plural, namespace, name))
            return copy.deepcopy(job.obj) if job else None

    def calls(self, method: str, path_contains: str = "") -> list[dict[str, Any]]:
        return [r for r in self.requests if r["method"] == method and path_contains in r["path"]]

    # --- state (call with the lock held) -------------------------------------------------------------------
    def _store(self, body: dict[str, Any], script: list[Step]) -> _Job:
        meta = body["metadata"]
        plural = next(p for (g, v, p) in KINDS if body["apiVersion"] == f"{g}/{v}")
        obj = copy.deepcopy(body)
        obj["metadata"].update(
            uid=str(uuid.uuid4()),
            resourceVersion=str(next(self._rv)),
            creationTimestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            generation=1,
        )
        obj["status"] = {}
        job = _Job(obj, plural, script)
        key = (plural, meta["namespace"], meta["name"])
        self._jobs[key] = job
        self._event("ADDED", key, obj)
        return job

    def _event(self, kind: str, key: tuple[str, str, str], obj: dict[str, Any]) -> None:
        self._events.append((int(obj["metadata"]["resourceVersion"]), kind, key, copy.deepcopy(obj)))
        self._lock.notify_all()

    def _advance(self, job: _Job) -> Step | None:
        if not job.script:
            return None
        step = job.script.pop(0)
        self._apply(job, step)
        return step

    def _apply(self, job: _Job, step: Step) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        conditions = {c["type"]: c for c in job.obj["status"].get("conditions", [])}
        for ctype, (status, reason, message) in step.conditions.items():
            conditions[ctype] = {
                "type": ctype,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": now,
            }
        job.obj["status"]["conditions"] = list(conditions.values())
        if step.pods is not None:
            job.pods = step.pods
        job.obj["metadata"]["resourceVersion"] = str(next(self._rv))
        meta = job.obj["metadata"]
        self._event("MODIFIED", (job.plural, meta["namespace"], meta["name"]), job.obj)

    # --- request handling ----------------------------------------------------------------------------------
    def handle(self, h: JsonHandler, method: str) -> None:
        url = urlsplit(h.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        length = int(h.headers.get("Content-Length") or 0)
        body = json.loads(h.rfile.read(length)) if length else None
        self.requests.append({"method": method, "path": url.path, "query": query, "body": body})
        parts = url.path.strip("/").split("/")
        if parts[:2] == ["api", "v1"] and len(parts) >= 5 and parts[4] == "pods":
            return self._pods(h, parts[3], parts[5:], query)
        if parts[0] == "apis" and len(parts) == 3 and method == "GET":
            return self._discovery(h, parts[1], parts[2])
        if parts[:3] == ["openapi", "v3", "apis"] and len(parts) == 5 and method == "GET":
            return self._openapi(h, parts[3], parts[4])
        if parts[0] == "apis" and len(parts) >= 6 and parts[3] == "namespaces":
            group, version, ns, plural = parts[1], parts[2], parts[4], parts[5]
            if (group, version, plural) in KINDS:
                return self._custom(h, method, plural, ns, parts[6] if len(parts) > 6 else None, query, body)
        return _status(h, 404, "NotFound", f"no route for {method} {url.path}")

    def _custom(self, h, method, plural, ns, name, query, body) -> None:
        key = (plural, ns, name)
        if method == "POST" and name is None:
            kind = body.get("kind", "")
            unknown = unknown_fields(body, self.schemas[kind], prune=query.get("fieldValidation") != "Strict")
            if unknown and query.get("fieldValidation") == "Strict":
                version = body.get("apiVersion", "").rsplit("/", 1)[-1]
                fields = ", ".join(f'unknown field "{path}"' for path in unknown)
                message = (
                    f'{kind} in version "{version}" cannot be handled as a {kind}: strict decoding error: {fields}'
                )
                return _status(h, 400, "BadRequest", message)
            self.pruned.extend(unknown)
            refused = self._runtime_webhook(body)
            if refused:
                return _status(h, 403, "Forbidden", refused)
            with self._lock:
                if (plural, ns, body["metadata"]["name"]) in self._jobs:
                    return _status(h, 409, "AlreadyExists", f'{plural} "{body["metadata"]["name"]}" already exists')
                script = self._scripts.pop(body["metadata"]["name"], None)
                job = self._store(body, script or [])
                if script is None and self.execute:
                    self._start(job)
                obj = copy.deepcopy(job.obj)
            return h.send_json(201, obj)
        if method == "GET" and name is not None:
            obj = self.job(plural, ns, name)
            return h.send_json(200, obj) if obj else _status(h, 404, "NotFound", f'{plural} "{name}" not found')
        if method == "GET" and query.get("watch", "").lower() in ("true", "1"):  # the client sends "True"
            return self._watch(h, plural, ns, query)
        if method == "GET":
            with self._lock:
                items = [copy.deepcopy(j.obj) for (p, n, _), j in self._jobs.items() if (p, n) == (plural, ns)]
            return h.send_json(200, {"items": items, "metadata": {"resourceVersion": str(next(self._rv))}})
        if method == "DELETE" and name is not None:
            with self._lock:
                job = self._jobs.pop(key, None)
                if job is None:
                    return _status(h, 404, "NotFound", f'{plural} "{name}" not found')
                for proc in job.procs:  # the pods go with the job
                    _kill(proc)
                job.obj["metadata"]["resourceVersion"] = str(next(self._rv))
                self._event("DELETED", key, job.obj)
            return _status(h, 200, "Success", "deleted")
        return _status(h, 405, "MethodNotAllowed", method)

    def _runtime_webhook(self, body: dict[str, Any]) -> str | None:
        """Trainer's answer to a TrainJob whose runtime the cluster lacks, else ``None``."""
        ref = body.get("spec", {}).get("runtimeRef", {})
        if body.get("kind") != "TrainJob" or self.runtimes is None or ref.get("name") in self.runtimes:
            return None
        kind = ref.get("kind", "ClusterTrainingRuntime")
        not_found = f'{kind.lower()}s.trainer.kubeflow.org "{ref.get("name")}" not found'
        return (
            'admission webhook "validator.trainjob.trainer.kubeflow.org" denied the request: spec.RuntimeRef: '
            f"Invalid value: {json.dumps(ref)}: {not_found}: specified {kind[0].lower()}{kind[1:]} must be "
            "created before the TrainJob is created"
        )

    def _watch(self, h, plural, ns, query) -> None:
        selector = query.get("fieldSelector", "")
        match = re.fullmatch(r"metadata\.name=([-a-z0-9.]+)", selector)
        if not match:
            return _status(h, 400, "BadRequest", f"this server watches one object by name, got {selector!r}")
        name = match.group(1)
        key = (plural, ns, name)
        since = int(query.get("resourceVersion") or 0)
        deadline = time.monotonic() + min(float(query.get("timeoutSeconds") or 30), 30.0)
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")  # as the API server: one event per chunk, as it happens
        h.end_headers()
        try:
            self._stream_events(h, key, name, since, deadline)
        finally:
            h.wfile.write(b"0\r\n\r\n")

    def _stream_events(self, h, key, name, since, deadline) -> None:
        if name in self._gone_once:
            self._gone_once.discard(name)
            gone = {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "reason": "Expired",
                "code": 410,
                "message": f"too old resource version: {since}",
            }
            return _write_line(h, {"type": "ERROR", "object": gone})
        sent = 0
        limit = self._close_after.get(name)
        while not self._stopping.is_set() and time.monotonic() < deadline:
            hook = None
            with self._lock:
                pending = [e for e in self._events if e[2] == key and e[0] > since]
                if not pending and key in self._jobs:
                    step = self._advance(self._jobs[key])  # nothing undelivered: the job moves on
                    hook = step.on_enter if step else None
                    pending = [e for e in self._events if e[2] == key and e[0] > since]
                if not pending and hook is None:
                    self._lock.wait(max(0.0, min(0.5, deadline - time.monotonic())))
                    continue
            if hook is not None:
                hook()  # before the step's event goes out: a hook may change how this watch ends
            for rv, kind, _, obj in pending:
                _write_line(h, {"type": kind, "object": obj})
                since, sent = rv, sent + 1
                if limit is not None and sent >= limit:
                    return

    def _pods(self, h, ns, rest, query) -> None:
        with self._lock:
            pods = {
                pod.name: (pod, job, KINDS[next(k for k in KINDS if k[2] == job.plural)])
                for (_, n, _), job in self._jobs.items()
                if n == ns
                for pod in job.pods
            }
        if not rest:  # list, filtered by label selector terms k=v
            terms = dict(t.split("=", 1) for t in query.get("labelSelector", "").split(",") if t)
            items = []
            for pod, job, (_, label, container) in pods.values():
                labels = {label: job.obj["metadata"]["name"]}
                if all(labels.get(k) == v for k, v in terms.items()):
                    items.append(
                        {
                            "metadata": {"name": pod.name, "namespace": ns, "labels": labels},
                            "spec": {"containers": [{"name": container, "image": "lmforge-train"}]},
                            "status": {"phase": pod.phase},
                        }
                    )
            return h.send_json(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})
        name = rest[0]
        if name not in pods:
            return _status(h, 404, "NotFound", f'pods "{name}" not found')
        pod, _, (_, _, container) = pods[name]
        if len(rest) == 2 and rest[1] == "log":
            if query.get("container") not in (None, container):
                return _status(h, 400, "BadRequest", f"container {query['container']} is not valid for pod {name}")
            if pod.phase == "Pending":
                return _status(h, 400, "BadRequest", f'container "{container}" in pod "{name}" is waiting to start')
            if pod.live and query.get("follow", "").lower() == "true":
                return self._follow(h, pod, int(query["tailLines"]) if "tailLines" in query else None)
            lines = pod.log[-int(query["tailLines"]) :] if "tailLines" in query else pod.log
            data = "".join(line + "\n" for line in lines).encode()
            return h.send_body(200, data, "text/plain")
        return _status(h, 404, "NotFound", "/".join(rest))

    def _follow(self, h, pod: Pod, tail: int | None) -> None:
        """Stream a live pod's log line by line (chunked) until its process has ended and every line is out."""
        h.send_response(200)
        h.send_header("Content-Type", "text/plain")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        with self._lock:
            sent = max(0, len(pod.log) - tail) if tail is not None else 0
        try:
            while not self._stopping.is_set():
                with self._lock:
                    lines, done = pod.log[sent:], not pod.live
                    if not lines and not done:
                        self._lock.wait(0.5)
                        continue
                for line in lines:
                    data = (line + "\n").encode()
                    h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                h.wfile.flush()
                sent += len(lines)
                if done and not lines:
                    break
        finally:
            h.wfile.write(b"0\r\n\r\n")

    def _discovery(self, h, group: str, version: str) -> None:
        resources = [
            {
                "name": plural,
                "singularName": kind.lower(),
                "namespaced": True,
                "kind": kind,
                "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
            }
            for (g, v, plural), (kind, _, _) in KINDS.items()
            if (g, v) == (group, version) and kind in self.served
        ]
        if not resources:
            return _status(h, 404, "NotFound", "the server could not find the requested resource")
        body = {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{group}/{version}"}
        return h.send_json(200, {**body, "resources": resources})

    def _openapi(self, h, group: str, version: str) -> None:
        """The group-version's OpenAPI v3 document: one schema per served kind, tagged with its GVK."""
        schemas = {
            f"{'.'.join(reversed(g.split('.')))}.{v}.{kind}": {
                **self.schemas[kind],
                "x-kubernetes-group-version-kind": [{"group": g, "version": v, "kind": kind}],
            }
            for (g, v, _), (kind, _, _) in KINDS.items()
            if (g, v) == (group, version) and kind in self.served
        }
        if not schemas:
            return _status(h, 404, "NotFound", "the server could not find the requested resource")
        return h.send_json(
            200, {"openapi": "3.0.0", "info": {"title": "Kubernetes"}, "components": {"schemas": schemas}}
        )

    # --- execute mode: run a created job's command locally, one process per node ----------------------------
    def _start(self, job: _Job) -> None:
        """Create the job's pods (Running) and start one process per node in the background (lock held)."""
        kind = job.obj["kind"]
        spec = job.obj["spec"]
        name = job.obj["metadata"]["name"]
        nodes, nproc = nodes_and_procs(job.obj)
        if kind == "TrainJob":
            trainer = spec["trainer"]
            command, env = trainer["command"], trainer.get("env", [])
            pod_names = [f"{name}-node-0-{i}-{uuid.uuid4().hex[:5]}" for i in range(nodes)]
        else:
            container = spec["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
            command, env = container["command"], container.get("env", [])
            pod_names = [f"{name}-master-0"] + [f"{name}-worker-{i}" for i in range(nodes - 1)]
        job.pods = [Pod(pod, "Running", live=True) for pod in pod_names]
        self._apply(job, created(kind))
        port = _free_port()
        launches = []
        for rank, pod in enumerate(job.pods):
            pet = {
                "PET_NNODES": str(nodes),
                "PET_NPROC_PER_NODE": str(nproc),
                "PET_NODE_RANK": str(rank),
                "PET_MASTER_ADDR": "127.0.0.1",
                "PET_MASTER_PORT": str(port),
            }
            launches.append((pod, _local_command(command), {**self._pod_env(pod.name, env), **pet}))
        threading.Thread(target=self._run, args=(job, launches), name=f"job-{name}", daemon=True).start()

    def _pod_env(self, pod: str, env: list[dict[str, Any]]) -> dict[str, str]:
        root = Path(self.workdir or "/tmp", pod)
        (root / "tmp").mkdir(parents=True, exist_ok=True)
        out = {"PATH": os.environ.get("PATH", ""), "HOME": str(root), "TMPDIR": str(root / "tmp"), **self.base_env}
        for item in env:
            if "value" in item:
                out[item["name"]] = item["value"]
                continue
            ref = item["valueFrom"]["secretKeyRef"]
            value = self.secrets.get(ref["name"], {}).get(ref["key"])
            if value is not None:
                out[item["name"]] = value
            elif not ref.get("optional"):  # the kubelet refuses to start the container
                out["__missing__"] = f"secret {ref['name']} key {ref['key']} not found"
        self.pod_envs[pod] = out
        return out

    def _run(self, job: _Job, launches: list[tuple[Pod, list[str], dict[str, str]]]) -> None:
        readers = []
        for pod, command, env in launches:
            if "__missing__" in env:
                with self._lock:
                    pod.log.append(f"CreateContainerConfigError: {env['__missing__']}")
                continue
            proc = subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
            )
            with self._lock:
                job.procs.append(proc)
            reader = threading.Thread(target=self._read, args=(pod, proc), daemon=True)
            reader.start()
            readers.append((pod, proc, reader))
        codes: dict[str, int] = {pod.name: 1 for pod, _, _ in launches}
        for pod, proc, reader in readers:
            reader.join()
            codes[pod.name] = proc.wait()
        kind = job.obj["kind"]
        with self._lock:
            for pod, _, _ in launches:
                pod.phase = "Succeeded" if codes[pod.name] == 0 else "Failed"
                pod.live = False
            failures = [f"{pod} exited with {code}" for pod, code in codes.items() if code != 0]
            if job.obj["metadata"]["name"] not in {key[2] for key in self._jobs}:
                return  # deleted meanwhile
            self._apply(job, failed(kind, "; ".join(failures)) if failures else succeeded(kind))

    def _read(self, pod: Pod, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._lock:
                pod.log.append(line.rstrip("\n"))
                self._lock.notify_all()
        with self._lock:
            self._lock.notify_all()


def _local_command(command: list[str]) -> list[str]:
    """The container command as this machine runs it: the test's Python stands in for the image's."""
    program, *rest = command
    if program == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *rest]
    if program in ("python", "python3"):
        return [sys.executable, *rest]
    return list(command)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()


def _status(h: JsonHandler, code: int, reason: str, message: str) -> None:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if code < 300 else "Failure",
        "reason": reason,
        "message": message,
        "code": code,
    }
    h.send_json(code, body)


def _write_line(h: JsonHandler, obj: Any) -> None:
    """One watch event as one HTTP chunk."""
    data = json.dumps(obj).encode() + b"\n"
    h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
    h.wfile.flush()


def _handler_for(server: K8sApiServer) -> type[JsonHandler]:
    class Handler(JsonHandler):
        protocol_version = "HTTP/1.1"  # chunked watch streams; every response then closes its connection

        def end_headers(self) -> None:
            self.send_header("Connection", "close")  # one request per connection keeps the server simple
            super().end_headers()

        def _serve(self) -> None:
            # The client may go away mid-response (it stopped a watch or a log stream): nothing left to send.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                server.handle(self, self.command)

        do_GET = do_POST = do_DELETE = _serve

    return Handler
