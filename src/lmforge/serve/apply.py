"""Create or update the serving objects in the cluster and wait until the InferenceService is Ready.

Each object (the lmforge ``ServingRuntime`` when that runtime is used, then the ``InferenceService``) is read by
name: absent, it is created; present, it is replaced with our spec at the resourceVersion read (a concurrent
writer makes that a 409, and the read-replace is tried again). Every write sends ``fieldValidation=Strict``, so a
field the cluster's KServe does not know fails the write instead of being dropped. Then the InferenceService is
read until its ``Ready`` condition is ``True`` for the generation we wrote (``status.observedGeneration``), or
it reports a failure, or ``timeout_s`` passes.

Outside a cluster (no service account, no kubeconfig) nothing is written, whatever ``apply`` says: the result says
``skipped: no cluster``, as ``build_tensorrt`` does without a GPU (so a ``kfp.local`` run reports that). In a cluster
with ``apply`` off it says ``skipped`` because ``serve.apply`` is off. RBAC needed (manifests/base/role.yaml):
``inferenceservices`` and ``servingruntimes`` in ``serving.kserve.io``: get, create, update.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from lmforge.errors import LmforgeError
from lmforge.launch.client import api_message, kube_api_client

log = logging.getLogger("lmforge.serve")

GROUP = "serving.kserve.io"
PLURALS = {"InferenceService": "inferenceservices", "ServingRuntime": "servingruntimes"}
_CONFLICT_RETRIES = 5
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class ServeApplyError(LmforgeError):
    """A serving object could not be written, or the InferenceService did not become Ready."""


@dataclass
class ApplyResult:
    """What :func:`apply_and_wait` did: ``applied`` (and Ready) or ``skipped`` with the reason."""

    status: str
    reason: str = ""
    url: str | None = None
    written: list[str] = field(default_factory=list)
    conditions: list[dict[str, Any]] = field(default_factory=list)


def cluster_available() -> bool:
    """True inside a pod (service account) or where a kubeconfig exists."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return True
    kubeconfig = os.environ.get("KUBECONFIG", str(Path.home() / ".kube" / "config"))
    return any(Path(p).is_file() for p in kubeconfig.split(os.pathsep) if p)


def _namespace(obj: Mapping[str, Any]) -> str:
    namespace = obj["metadata"].get("namespace")
    if namespace:
        return str(namespace)
    if SERVICE_ACCOUNT_NAMESPACE.is_file():
        return SERVICE_ACCOUNT_NAMESPACE.read_text(encoding="utf-8").strip()
    raise ServeApplyError(f"{obj['kind']} {obj['metadata']['name']}: no namespace (set serve.namespace)")


def create_or_replace(custom: Any, obj: Mapping[str, Any]) -> dict[str, Any]:
    """Create ``obj``, or replace the existing object of its name with it; return what the server stored."""
    kind, name = obj["kind"], obj["metadata"]["name"]
    group, version = obj["apiVersion"].split("/")
    namespace = _namespace(obj)
    path = (group, version, namespace, PLURALS[kind])
    body = {**obj, "metadata": {**obj["metadata"], "namespace": namespace}}
    for _ in range(_CONFLICT_RETRIES):
        try:
            existing = custom.get_namespaced_custom_object(*path, name)
        except ApiException as exc:
            if exc.status != 404:
                raise ServeApplyError(f"{kind} {namespace}/{name}: get failed: HTTP {exc.status} {exc.reason}") from exc
            existing = None
        try:
            if existing is None:
                stored = custom.create_namespaced_custom_object(*path, body=body, field_validation="Strict")
                log.info("%s %s/%s: created", kind, namespace, name)
            else:
                version_read = existing["metadata"]["resourceVersion"]
                replacement = {**body, "metadata": {**body["metadata"], "resourceVersion": version_read}}
                stored = custom.replace_namespaced_custom_object(
                    *path, name, body=replacement, field_validation="Strict"
                )
                log.info("%s %s/%s: replaced (was at resourceVersion %s)", kind, namespace, name, version_read)
            return stored
        except ApiException as exc:
            if exc.status == 409:  # created or changed since we read it: read again
                continue
            raise ServeApplyError(
                f"{kind} {namespace}/{name}: write failed: HTTP {exc.status} {exc.reason}: {api_message(exc)}"
            ) from exc
    raise ServeApplyError(f"{kind} {namespace}/{name}: still conflicting after {_CONFLICT_RETRIES} attempts")


def ready_state(isvc: Mapping[str, Any], generation: int | None) -> tuple[str, list[dict[str, Any]]]:
    """``("ready" | "failed" | "waiting", conditions)`` of an InferenceService for the ``generation`` written."""
    status = isvc.get("status") or {}
    conditions = list(status.get("conditions") or [])
    if generation is not None and int(status.get("observedGeneration") or 0) < generation:
        return "waiting", conditions  # the controller has not looked at our spec yet
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    if ready and ready.get("status") == "True":
        return "ready", conditions
    failed = (status.get("modelStatus") or {}).get("transitionStatus") == "BlockedByFailedLoad"
    return ("failed" if failed else "waiting"), conditions


def apply_and_wait(
    objects: Sequence[Mapping[str, Any]],
    *,
    apply: bool,
    timeout_s: float,
    api_client: Any = None,
    poll_s: float = 2.0,
) -> ApplyResult:
    """Write ``objects`` (the InferenceService last) and wait for it to be Ready; see the module docstring.

    Raises:
        ServeApplyError: a write failed, the model failed to load, or ``timeout_s`` passed before Ready.
    """
    if api_client is None and not cluster_available():
        return ApplyResult("skipped", "no cluster")
    if not apply:
        return ApplyResult("skipped", "serve.apply is off; the manifests were only written")
    if api_client is None:
        api_client = kube_api_client()
    custom = k8s.CustomObjectsApi(api_client)
    isvc = objects[-1]
    if isvc["kind"] != "InferenceService":
        raise ServeApplyError(f"the last object to apply must be the InferenceService, got {isvc['kind']}")
    written, stored = [], {}
    for obj in objects:
        stored = create_or_replace(custom, obj)
        written.append(f"{obj['kind']}/{obj['metadata']['name']}")
    generation = (stored.get("metadata") or {}).get("generation")
    name, namespace = isvc["metadata"]["name"], stored["metadata"]["namespace"]
    path = (*isvc["apiVersion"].split("/"), namespace, PLURALS["InferenceService"])
    deadline = time.monotonic() + timeout_s
    while True:
        current = custom.get_namespaced_custom_object(*path, name)
        state, conditions = ready_state(current, generation)
        if state == "ready":
            url = (current.get("status") or {}).get("url")
            log.info("InferenceService %s/%s is Ready at %s", namespace, name, url)
            return ApplyResult("applied", "Ready", url, written, conditions)
        if state == "failed" or time.monotonic() > deadline:
            why = "failed to load its model" if state == "failed" else f"was not Ready within {timeout_s:.0f} s"
            detail = "; ".join(
                f"{c.get('type')}={c.get('status')} {c.get('message') or ''}".strip() for c in conditions
            )
            raise ServeApplyError(f"InferenceService {namespace}/{name} {why} ({detail or 'no conditions'})")
        time.sleep(poll_s)
