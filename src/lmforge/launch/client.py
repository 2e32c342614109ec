"""Submit a training job, or adopt the one a previous attempt submitted, and wait for it with a watch.

Flow of :func:`launch_and_wait`:

1. ``GET`` the job by its deterministic name. Found: adopt it (a retried pipeline step never starts a
   duplicate); a Failed one is deleted and resubmitted when ``recreate_failed`` (checkpoints resume it).
   Not found: ``POST`` it (a 409 from a concurrent attempt is adopted too).
2. Watch the job (``fieldSelector=metadata.name=<job>``) from the resourceVersion last seen, one window
   of ``watch_window_s`` at a time; a 410 Gone re-reads the job and watches on from its new version.
   Between windows the job's pods are listed (by the label the operator sets) and each started pod's
   log is followed in a thread, line by line into this process's log.
3. Complete/Succeeded: return. Failed: raise :class:`LaunchError` with the condition's reason and
   message and the last log lines of the (failed) pods. SIGTERM / Ctrl-C / the wait timeout: delete the
   job, then raise.

RBAC needed (manifests/base/role.yaml): the job kinds: create/get/list/watch/delete; pods: get/list;
pods/log: get.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client as k8s
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as TransportError

from lmforge.config import LaunchConfig
from lmforge.errors import LmforgeError
from lmforge.launch.cancel import CancelRequested, sigterm_raises
from lmforge.launch.manifests import (
    TRAINJOB,
    JobKind,
    PodOverrides,
    build_job,
    describe_command,
    job_command,
    kind_of,
)

log = logging.getLogger("lmforge.launch")

LogCallback = Callable[[str, str], None]
MAX_BROKEN_WATCHES = 6  # consecutive connection failures (about a minute of backoff) before giving up


class LaunchError(LmforgeError):
    """A launched training job failed, vanished, or could not be submitted."""


class LaunchCancelled(LaunchError):
    """Waiting was interrupted (SIGTERM, e.g. the pipeline run was cancelled); the job was deleted."""


class LaunchTimeout(LaunchError):
    """The job did not finish within the wait timeout; the job was deleted."""


@dataclass
class LaunchResult:
    """What :func:`launch_and_wait` observed."""

    name: str
    namespace: str
    kind: str
    adopted: bool
    conditions: list[dict[str, Any]]
    log_tail: dict[str, list[str]] = field(default_factory=dict)


# Kubeflow Trainer's webhook refusing a TrainJob whose (Cluster)TrainingRuntime the cluster lacks, and what to do.
_NO_RUNTIME = "trainingruntime must be created before the trainjob"
_NO_RUNTIME_HINT = (
    "the cluster has no runtime of that name: a cluster admin installs lmforge's once with "
    "`kubectl apply -k manifests/trainer-runtimes`, or set launch.runtime_name to a runtime the cluster has"
)


def api_message(exc: ApiException) -> str:
    """The ``message`` of the API server's ``Status`` answer, else its raw body."""
    try:
        return str(json.loads(exc.body)["message"])
    except (TypeError, ValueError, KeyError):
        return str(exc.body)


def kube_api_client() -> k8s.ApiClient:
    """An API client from the pod's service account, else from ``~/.kube/config``."""
    from kubernetes import config as k8s_config

    try:
        k8s_config.load_incluster_config()
    except k8s_config.ConfigException:
        k8s_config.load_kube_config()
    return k8s.ApiClient()


def job_state(job: Mapping[str, Any], kind: JobKind) -> tuple[str, dict[str, Any] | None]:
    """``("succeeded" | "failed" | "running", condition)`` from the job's ``status.conditions``."""
    conditions = (job.get("status") or {}).get("conditions") or []
    for wanted, state in ((kind.failed, "failed"), (kind.succeeded, "succeeded")):
        for cond in conditions:
            if cond.get("type") == wanted and cond.get("status") == "True":
                return state, cond
    return "running", None


class _LogFollower(threading.Thread):
    """Follow one pod's container log; keep the last lines; hand each line to the logger and a callback."""

    def __init__(
        self,
        core: k8s.CoreV1Api,
        pod: str,
        namespace: str,
        container: str,
        tail: int,
        keep: int,
        on_log: LogCallback | None,
    ) -> None:
        super().__init__(name=f"log-{pod}", daemon=True)
        self.core, self.pod, self.namespace, self.container = core, pod, namespace, container
        self.tail, self.on_log = tail, on_log
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self.error: str | None = None
        self._resp: Any = None

    def run(self) -> None:
        kwargs: dict[str, Any] = {"container": self.container, "follow": True, "_preload_content": False}
        if self.tail:
            kwargs["tail_lines"] = self.tail
        try:
            self._resp = self.core.read_namespaced_pod_log(self.pod, self.namespace, **kwargs)
            for line in _iter_lines(self._resp):
                self.lines.append(line)
                log.info("[%s] %s", self.pod, line)
                if self.on_log is not None:
                    self.on_log(self.pod, line)
        except ApiException as exc:
            self.error = f"HTTP {exc.status}: {exc.reason}"
        except (TransportError, OSError, ValueError) as exc:  # stop() closed the stream, or the connection broke
            self.error = f"{type(exc).__name__}: {exc}"
            log.debug("[%s] log stream ended: %s", self.pod, self.error)
        finally:
            if self._resp is not None:
                self._resp.release_conn()

    def stop(self) -> None:
        if self._resp is not None:
            with contextlib.suppress(Exception):
                self._resp.close()


def _iter_lines(resp: Any) -> Iterator[str]:
    pending = b""
    for chunk in resp.stream(4096, decode_content=True):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.decode("utf-8", "replace").rstrip("\r")
    if pending:
        yield pending.decode("utf-8", "replace")


class _Launch:
    """One launch: the API handles, the job's identity and the log followers."""

    def __init__(
        self,
        manifest: Mapping[str, Any],
        api_client: k8s.ApiClient,
        *,
        watch_window_s: int,
        log_tail_lines: int,
        on_log: LogCallback | None,
    ) -> None:
        self.manifest = manifest
        self.kind = kind_of(manifest)
        self.name: str = manifest["metadata"]["name"]
        self.namespace: str = manifest["metadata"]["namespace"]
        self.custom = k8s.CustomObjectsApi(api_client)
        self.core = k8s.CoreV1Api(api_client)
        self.window = watch_window_s
        self.keep = log_tail_lines
        self.on_log = on_log
        self.followers: dict[str, _LogFollower] = {}
        self.adopted = False

    @property
    def ref(self) -> str:
        return f"{self.kind.kind} {self.namespace}/{self.name}"

    def _path(self) -> tuple[str, str, str, str]:
        return self.kind.group, self.kind.version, self.namespace, self.kind.plural

    def get(self) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(*self._path(), self.name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise LaunchError(f"{self.ref}: get failed: HTTP {exc.status} {exc.reason}") from exc

    def create(self) -> dict[str, Any]:
        try:
            # Strict: a field the cluster's CRD lacks fails the create instead of being pruned silently.
            job = self.custom.create_namespaced_custom_object(
                *self._path(), body=dict(self.manifest), field_validation="Strict"
            )
        except ApiException as exc:
            if exc.status == 409:  # another attempt created it between our GET and POST: adopt that one
                existing = self.get()
                if existing is not None:
                    self.adopted = True
                    return existing
            reason = f"HTTP {exc.status} {exc.reason}: {api_message(exc)}"
            if _NO_RUNTIME in reason.lower():
                reason += f" ({_NO_RUNTIME_HINT})"
            raise LaunchError(f"{self.ref}: create failed: {reason}") from exc
        log.info("%s: created", self.ref)
        return job

    def delete(self, *, wait_s: float = 0.0) -> None:
        """Delete the job and, through owner references, its pods; optionally wait until it is gone."""
        body = k8s.V1DeleteOptions(propagation_policy="Foreground" if wait_s else "Background")
        try:
            self.custom.delete_namespaced_custom_object(*self._path(), self.name, body=body)
        except ApiException as exc:
            if exc.status != 404:
                raise LaunchError(f"{self.ref}: delete failed: HTTP {exc.status} {exc.reason}") from exc
        log.info("%s: deleted", self.ref)
        deadline = time.monotonic() + wait_s
        delay = 0.05
        while wait_s and self.get() is not None:
            if time.monotonic() > deadline:
                raise LaunchError(f"{self.ref}: still present {wait_s:.0f} s after delete; cannot resubmit it")
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def submit_or_adopt(self, recreate_failed: bool) -> dict[str, Any]:
        existing = self.get()
        if existing is None:
            return self.create()
        state, cond = job_state(existing, self.kind)
        if state == "failed" and recreate_failed:
            log.warning(
                "%s: found Failed from an earlier attempt (%s); deleting and resubmitting", self.ref, _cond_text(cond)
            )
            self.delete(wait_s=120)
            return self.create()
        self.adopted = True
        want = self.manifest["metadata"]["annotations"].get("lmforge.io/spec-hash")
        have = (existing["metadata"].get("annotations") or {}).get("lmforge.io/spec-hash")
        if want != have:
            log.warning(
                "%s: adopting a job whose spec differs from this attempt's (spec-hash %s, now %s)", self.ref, have, want
            )
        log.info("%s: adopted the existing job (%s)", self.ref, state)
        return existing

    def pods(self) -> list[k8s.V1Pod]:
        selector = f"{self.kind.pod_label}={self.name}"
        return self.core.list_namespaced_pod(self.namespace, label_selector=selector).items

    def follow_logs(self) -> None:
        """Start a log follower for every pod that has started and is not followed yet."""
        for pod in self.pods():
            name = pod.metadata.name
            follower = self.followers.get(name)
            if pod.status is None or pod.status.phase not in ("Running", "Succeeded", "Failed"):
                continue
            if follower is not None and not (follower.error and not follower.lines):
                continue  # already followed (a follower that failed before reading anything is retried)
            tail = self.keep if self.adopted else 0  # adopted: do not replay hours of log
            follower = _LogFollower(self.core, name, self.namespace, self.kind.container, tail, self.keep, self.on_log)
            self.followers[name] = follower
            follower.start()

    def finish_logs(self, timeout_s: float) -> dict[str, list[str]]:
        """Pick up pods not yet followed, let the followers drain, then stop them."""
        with contextlib.suppress(ApiException, TransportError):
            self.follow_logs()
        deadline = time.monotonic() + timeout_s
        for follower in self.followers.values():
            follower.join(max(0.0, deadline - time.monotonic()))
        for follower in self.followers.values():
            follower.stop()
        return {name: list(f.lines) for name, f in sorted(self.followers.items())}

    def wait(self, job: dict[str, Any], deadline: float | None) -> dict[str, Any]:
        """Watch the job until it succeeds or fails; return its last state."""
        version = job["metadata"].get("resourceVersion")
        broken = 0  # consecutive watch requests that failed on the connection
        while job_state(job, self.kind)[0] == "running":
            window = self._window(deadline)
            with contextlib.suppress(ApiException, TransportError):  # pods/logs: best effort; job state: not
                self.follow_logs()
            watcher = k8s_watch.Watch()
            started, events = time.monotonic(), 0
            try:
                for event in self._watch(watcher, version, window):
                    events += 1
                    version = event["raw_object"].get("metadata", {}).get("resourceVersion", version)
                    update = self._job_of(event)
                    if update is None:
                        continue
                    job = update
                    if job_state(job, self.kind)[0] != "running":
                        watcher.stop()
                        break
            except ApiException as exc:
                job, version = self._reread_after_expiry(exc, version)
                continue
            except TransportError as exc:  # a dropped or stalled connection: watch again from the same version
                broken += 1
                self._back_off(broken, exc)
                continue
            broken = 0
            if not events and time.monotonic() - started < 1.0:
                time.sleep(1.0)  # a watch that ends at once with nothing (a proxy, an API hiccup): do not spin
        return job

    def _window(self, deadline: float | None) -> int:
        """Seconds of the next watch: ``watch_window_s``, cut to what is left before ``deadline``.

        Raises:
            _Timeout: the deadline has passed.
        """
        if deadline is None:
            return self.window
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Timeout
        return max(1, min(self.window, int(left) + 1))

    def _watch(self, watcher: k8s_watch.Watch, version: str | None, window: int) -> Iterator[dict[str, Any]]:
        """The events of one watch window on this job, from ``version``."""
        return watcher.stream(
            self.custom.list_namespaced_custom_object,
            *self._path(),
            field_selector=f"metadata.name={self.name}",
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=window,
            _request_timeout=(10, window + 30),
        )

    def _job_of(self, event: Mapping[str, Any]) -> dict[str, Any] | None:
        """The job a watch event carries; ``None`` for a bookmark. Raises when the job was deleted."""
        if event["type"] == "BOOKMARK":
            return None
        if event["type"] == "DELETED":
            raise LaunchError(f"{self.ref} was deleted while running (by someone else?)")
        return event["raw_object"]

    def _reread_after_expiry(self, exc: ApiException, version: str | None) -> tuple[dict[str, Any], str | None]:
        """After a watch failed with ``exc``: on 410 Gone, the job read afresh and its version; else raise."""
        if exc.status != 410:
            raise LaunchError(f"{self.ref}: watch failed: HTTP {exc.status} {exc.reason}") from exc
        # 410 Gone: our resourceVersion was compacted away; read the job afresh and watch from there.
        log.debug("%s: watch version %s expired; re-reading", self.ref, version)
        fresh = self.get()
        if fresh is None:
            raise LaunchError(f"{self.ref} disappeared while running (deleted by someone else?)") from exc
        return fresh, fresh["metadata"].get("resourceVersion")

    def _back_off(self, broken: int, exc: TransportError) -> None:
        """Wait before watching again after ``broken`` connection failures in a row; raise after too many."""
        if broken >= MAX_BROKEN_WATCHES:
            raise LaunchError(f"{self.ref}: lost the API server {broken} times in a row: {exc}") from exc
        log.warning("%s: watch connection failed (%s); watching again", self.ref, exc)
        time.sleep(min(2.0**broken, 30.0))


class _Timeout(BaseException):
    pass


def _cond_text(cond: Mapping[str, Any] | None) -> str:
    if not cond:
        return "no condition"
    return ": ".join(str(p) for p in (cond.get("reason"), cond.get("message")) if p) or str(cond.get("type"))


def _failure_message(
    launch: _Launch, cond: Mapping[str, Any] | None, tails: dict[str, list[str]], pods_failed: set[str], n: int
) -> str:
    shown = {p: lines for p, lines in tails.items() if p in pods_failed} or tails
    parts = [f"{launch.ref} failed: {_cond_text(cond)}"]
    for pod, lines in shown.items():
        parts.append(f"--- last {min(n, len(lines))} log lines of pod {pod} ---")
        parts.extend(lines[-n:])
    if not shown:
        parts.append(
            f"(no pod logs could be read; try `kubectl -n {launch.namespace} describe "
            f"{launch.kind.plural} {launch.name}`)"
        )
    return "\n".join(parts)


def launch_and_wait(
    manifest: Mapping[str, Any],
    *,
    api_client: k8s.ApiClient | None = None,
    timeout_s: float | None = None,
    watch_window_s: int = 30,
    delete_on_success: bool = False,
    recreate_failed: bool = True,
    log_tail_lines: int = 50,
    log_drain_s: float = 30.0,
    on_log: LogCallback | None = None,
) -> LaunchResult:
    """Create (or adopt) the job ``manifest`` describes and block until it finishes.

    Args:
        manifest: A TrainJob or PyTorchJob from :mod:`lmforge.launch.manifests` (name and namespace set).
        api_client: Kubernetes API client; default: in-cluster service account, else ``~/.kube/config``.
        timeout_s: Give up after this many seconds: the job is deleted and :class:`LaunchTimeout` raised.
        watch_window_s: Length of one watch request; new pods (and their logs) are picked up in between.
        delete_on_success: Delete the finished job (and pods) after success; a failed job is always kept
            for inspection (and replaced by the next attempt when ``recreate_failed``).
        recreate_failed: An existing Failed job (from an earlier attempt of this step) is deleted and
            submitted again instead of adopted.
        log_tail_lines: Lines per pod kept for the error message (and replayed when adopting).
        log_drain_s: At the end, how long to wait for the pods' log streams to finish.
        on_log: Called with (pod, line) for every log line read, besides logging it.

    Returns:
        :class:`LaunchResult` of the succeeded job.

    Raises:
        LaunchError: The job failed (condition message and last log lines), vanished or was refused.
        LaunchCancelled: SIGTERM arrived while waiting; the job was deleted. (Ctrl-C: the job is deleted
            and ``KeyboardInterrupt`` propagates.)
        LaunchTimeout: ``timeout_s`` passed; the job was deleted.
    """
    launch = _Launch(
        manifest,
        api_client or kube_api_client(),
        watch_window_s=watch_window_s,
        log_tail_lines=log_tail_lines,
        on_log=on_log,
    )
    log.info("%s: %s", launch.ref, describe_command(job_command(manifest)))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with sigterm_raises():  # kept through the cleanup: its handler ignores a second SIGTERM meanwhile
        try:
            job = launch.submit_or_adopt(recreate_failed)
            job = launch.wait(job, deadline)
        except (CancelRequested, KeyboardInterrupt, _Timeout) as exc:
            why = "timeout" if isinstance(exc, _Timeout) else str(exc) or type(exc).__name__
            log.warning("%s: %s while waiting; deleting the job", launch.ref, why)
            try:
                launch.delete()
            finally:
                launch.finish_logs(timeout_s=1.0)
            if isinstance(exc, KeyboardInterrupt):
                raise
            if isinstance(exc, _Timeout):
                raise LaunchTimeout(f"{launch.ref} did not finish within {timeout_s:.0f} s; deleted it") from None
            raise LaunchCancelled(f"{launch.ref}: cancelled by {exc}; deleted the job") from None
        except BaseException:
            launch.finish_logs(timeout_s=1.0)
            raise

    state, cond = job_state(job, launch.kind)
    tails = launch.finish_logs(timeout_s=log_drain_s)
    conditions = (job.get("status") or {}).get("conditions") or []
    if state == "failed":
        failed_pods: set[str] = set()
        with contextlib.suppress(ApiException, TransportError):
            failed_pods = {p.metadata.name for p in launch.pods() if p.status and p.status.phase == "Failed"}
        raise LaunchError(_failure_message(launch, cond, tails, failed_pods, log_tail_lines))
    log.info("%s: %s", launch.ref, _cond_text(cond))
    if delete_on_success:
        launch.delete()
    return LaunchResult(launch.name, launch.namespace, launch.kind.kind, launch.adopted, conditions, tails)


def _resolve_ref(doc: Mapping[str, Any], schema: Mapping[str, Any]) -> Mapping[str, Any]:
    for ref in [schema.get("$ref"), *(part.get("$ref") for part in schema.get("allOf") or [])]:
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            return doc.get("components", {}).get("schemas", {}).get(ref.rsplit("/", 1)[-1], {})
    return schema


def served_trainjob_pod_overrides(api_client: k8s.ApiClient) -> PodOverrides:
    """The TrainJob field that places pods on this cluster: ``runtimePatches`` or ``podTemplateOverrides``.

    Read from the API server's OpenAPI v3 document for ``trainer.kubeflow.org/v1alpha1``, which any
    authenticated client may read (the pipeline's namespaced Role cannot read the cluster-scoped CRD).
    Kubeflow Trainer v2.1 has ``podTemplateOverrides``, v2.2 and later ``runtimePatches``.
    """
    path = f"/openapi/v3/apis/{TRAINJOB.group}/{TRAINJOB.version}"
    try:
        doc = api_client.call_api(
            path, "GET", auth_settings=["BearerToken"], response_type="object", _return_http_data_only=True
        )
    except ApiException as exc:
        raise LaunchError(
            f"{path}: HTTP {exc.status} {exc.reason}; set launch.trainjob_pod_overrides to runtimePatches "
            "(Kubeflow Trainer >= v2.2) or podTemplateOverrides (v2.1)"
        ) from exc
    for schema in (doc or {}).get("components", {}).get("schemas", {}).values():
        kinds = {gvk.get("kind") for gvk in schema.get("x-kubernetes-group-version-kind") or []}
        if TRAINJOB.kind not in kinds:
            continue
        spec = _resolve_ref(doc, schema.get("properties", {}).get("spec", {}))
        fields = set(spec.get("properties", {}))
        for name in ("runtimePatches", "podTemplateOverrides"):
            if name in fields:
                log.info("%s: TrainJob places pods with spec.%s", path, name)
                return name  # type: ignore[return-value]
        raise LaunchError(f"{path}: TrainJob has neither runtimePatches nor podTemplateOverrides: {sorted(fields)}")
    raise LaunchError(f"{path}: no TrainJob schema; is Kubeflow Trainer v2 installed?")


def launch(
    cfg: LaunchConfig,
    args: Sequence[str],
    *,
    image: str,
    run_id: str,
    task: str,
    api_client: k8s.ApiClient | None = None,
    on_log: LogCallback | None = None,
) -> LaunchResult:
    """Build the job ``cfg`` describes for (run id, task) and :func:`launch_and_wait` for it."""
    api_client = api_client or kube_api_client()
    pod_overrides: PodOverrides = "runtimePatches"
    if cfg.backend == "trainjob" and cfg.trainjob_pod_overrides == "auto":
        pod_overrides = served_trainjob_pod_overrides(api_client)
    manifest = build_job(cfg, args, image=image, run_id=run_id, task=task, pod_overrides=pod_overrides)
    return launch_and_wait(
        manifest,
        api_client=api_client,
        timeout_s=cfg.wait_timeout_s,
        watch_window_s=cfg.watch_window_s,
        delete_on_success=cfg.delete_on_success,
        recreate_failed=cfg.recreate_failed,
        log_tail_lines=cfg.log_tail_lines,
        on_log=on_log,
    )
