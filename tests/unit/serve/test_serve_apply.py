"""Create-or-replace of the serving objects and the wait for Ready, against a KServe-API-shaped server on loopback.

The server speaks the real paths and JSON of ``serving.kserve.io`` custom objects (create, get, replace with
``resourceVersion``, 409 on a conflict) and applies the API server's unknown-field rule with the real CRDs
(tests/support/crd_schema.py): with ``fieldValidation=Strict`` an undeclared field is a 400. Its controller sets the
InferenceService Ready one read after a write, first reporting the previous generation (a stale Ready).
"""

from __future__ import annotations

import copy
import json
import threading
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes
import pytest

from lmforge.config.base import validate_config
from lmforge.config.serve import ServeConfig
from lmforge.serve.apply import ServeApplyError, apply_and_wait
from lmforge.serve.manifests import build_inference_service, build_serving_runtime
from tests.fakes.json_handler import JsonHandler
from tests.support.crd_schema import CRDS, crd_schema, unknown_fields

SCHEMAS = {
    "inferenceservices": crd_schema(CRDS / "kserve/v0.20.0/serving.kserve.io_inferenceservices.yaml", "v1beta1"),
    "servingruntimes": crd_schema(CRDS / "kserve/v0.20.0/serving.kserve.io_clusterservingruntimes.yaml", "v1alpha1"),
}


class FakeKServe:
    """Custom objects of serving.kserve.io in memory; ``ready`` False keeps every InferenceService not Ready."""

    def __init__(self, ready: bool = True) -> None:
        self.ready = ready
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str, dict[str, list[str]]]] = []
        self.version = 0
        self._lock = threading.Lock()
        handler = type("H", (_Handler,), {"fake": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def client(self) -> kubernetes.client.ApiClient:
        cfg = kubernetes.client.Configuration()
        cfg.host = self.url
        return kubernetes.client.ApiClient(cfg)

    def handle(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        self.calls.append((method, path, query))
        parts = path.strip("/").split("/")  # apis/serving.kserve.io/<v>/namespaces/<ns>/<plural>[/<name>]
        ns, plural = parts[4], parts[5]
        name = parts[6] if len(parts) > 6 else (body or {}).get("metadata", {}).get("name")
        key = (plural, ns, name)
        with self._lock:
            if method == "GET":
                obj = self.objects.get(key)
                if obj is None:
                    return 404, _status(404, "NotFound", f'{plural} "{name}" not found')
                if plural == "inferenceservices":
                    self._reconcile(obj)
                return 200, copy.deepcopy(obj)
            unknown = unknown_fields(body, SCHEMAS[plural])
            if unknown and query.get("fieldValidation") == ["Strict"]:
                return 400, _status(400, "BadRequest", f'strict decoding error: unknown field "{unknown[0]}"')
            if method == "POST":
                if key in self.objects:
                    return 409, _status(409, "AlreadyExists", f'{plural} "{name}" already exists')
                generation = 1
            else:
                old = self.objects.get(key)
                if old is None:
                    return 404, _status(404, "NotFound", f'{plural} "{name}" not found')
                if body["metadata"].get("resourceVersion") != old["metadata"]["resourceVersion"]:
                    return 409, _status(409, "Conflict", "the object has been modified")
                generation = old["metadata"]["generation"] + 1
            self.version += 1
            obj = copy.deepcopy(body)
            obj["metadata"].update(resourceVersion=str(self.version), generation=generation)
            old_status = (self.objects.get(key) or {}).get("status")
            # A replaced service keeps reporting the old generation's Ready until the controller catches up.
            obj["status"] = old_status or {}
            obj["_reads"] = 0
            self.objects[key] = obj
            return 201 if method == "POST" else 200, {k: v for k, v in obj.items() if k != "_reads"}

    def _reconcile(self, obj: dict[str, Any]) -> None:
        obj["_reads"] += 1
        if self.ready and obj["_reads"] >= 2:
            name, ns = obj["metadata"]["name"], obj["metadata"]["namespace"]
            obj["status"] = {
                "observedGeneration": obj["metadata"]["generation"],
                "url": f"http://{name}.{ns}.example.com",
                "conditions": [{"type": "Ready", "status": "True"}],
            }
        elif not obj["status"]:
            obj["status"] = {"conditions": [{"type": "Ready", "status": "False", "message": "Revision missing"}]}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }


class _Handler(JsonHandler):
    fake: FakeKServe

    def _serve(self) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        code, payload = self.fake.handle(self.command, url.path, parse_qs(url.query), body)
        self.send_json(code, {k: v for k, v in payload.items() if k != "_reads"})

    do_GET = do_POST = do_PUT = _serve


@pytest.fixture
def fake():
    server = FakeKServe()
    yield server
    server.close()


def _objects(**fields) -> list[dict[str, Any]]:
    cfg = validate_config(ServeConfig, {"namespace": "team-a", "image": "registry.example/lmforge-serve:1", **fields})
    isvc = build_inference_service(cfg, storage_uri="s3://b/models/demo/v1/int8_dynamic", model_name="demo")
    return [build_serving_runtime(cfg), isvc]


def test_apply_creates_the_runtime_and_service_strictly_and_waits_for_ready(fake) -> None:
    result = apply_and_wait(_objects(), apply=True, timeout_s=30, api_client=fake.client(), poll_s=0.01)
    assert (result.status, result.url) == ("applied", "http://demo.team-a.example.com")
    assert result.written == ["ServingRuntime/lmforge-onnx", "InferenceService/demo"]
    writes = [(m, q) for m, _, q in fake.calls if m != "GET"]
    assert [m for m, _ in writes] == ["POST", "POST"]
    assert all(q.get("fieldValidation") == ["Strict"] for _, q in writes)


def test_apply_again_replaces_at_the_version_read_and_waits_for_the_new_generation(fake) -> None:
    apply_and_wait(_objects(), apply=True, timeout_s=30, api_client=fake.client(), poll_s=0.01)
    fake.calls.clear()
    result = apply_and_wait(
        _objects(canary_traffic_percent=20), apply=True, timeout_s=30, api_client=fake.client(), poll_s=0.01
    )
    assert result.status == "applied"
    assert [m for m, _, _ in fake.calls if m != "GET"] == ["PUT", "PUT"]
    stored = fake.objects[("inferenceservices", "team-a", "demo")]
    assert stored["metadata"]["generation"] == 2 and stored["spec"]["predictor"]["canaryTrafficPercent"] == 20
    # The stale Ready of generation 1 was read once and not taken for the new spec's.
    service_reads = [p for m, p, _ in fake.calls if m == "GET" and p.endswith("/inferenceservices/demo")]
    assert len(service_reads) >= 3


def test_a_field_the_cluster_does_not_know_fails_the_apply_with_the_servers_message(fake) -> None:
    objects = _objects()
    objects[-1]["spec"]["predictor"]["model"]["replicas"] = 2
    with pytest.raises(ServeApplyError, match=r'unknown field "spec.predictor.model.replicas"'):
        apply_and_wait(objects, apply=True, timeout_s=30, api_client=fake.client(), poll_s=0.01)


def test_a_service_that_never_gets_ready_fails_after_the_timeout_with_its_conditions() -> None:
    server = FakeKServe(ready=False)
    try:
        with pytest.raises(ServeApplyError, match="was not Ready within .* Revision missing"):
            apply_and_wait(_objects(), apply=True, timeout_s=0.2, api_client=server.client(), poll_s=0.01)
    finally:
        server.close()


def test_without_apply_or_without_a_cluster_nothing_is_written(fake, monkeypatch, tmp_path) -> None:
    off = apply_and_wait(_objects(), apply=False, timeout_s=1, api_client=fake.client())
    assert off.status == "skipped" and "serve.apply is off" in off.reason
    assert fake.calls == []
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    for apply in (True, False):  # no cluster is the reason either way (a kfp.local run says so)
        result = apply_and_wait(_objects(), apply=apply, timeout_s=1)
        assert (result.status, result.reason) == ("skipped", "no cluster")
