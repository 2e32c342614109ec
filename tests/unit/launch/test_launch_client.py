"""lmforge.launch against a Kubernetes-API-shaped server on loopback (tests/fakes/k8s_api_server.py).

Submit, adopt, watch (resourceVersion, 410 Gone), log streaming, failure, cancellation and cleanup:
the real kubernetes client, real HTTP, a scripted job instead of an operator.
"""

from __future__ import annotations

import os
import signal

import kubernetes
import pytest

import lmforge.launch.client as client_module
from lmforge.config import LaunchConfig
from lmforge.launch import (
    LaunchCancelled,
    LaunchError,
    LaunchTimeout,
    build_job,
    launch,
    launch_and_wait,
    stage_args,
)
from tests.fakes.k8s_api_server import K8sApiServer, Pod, created, failed, running, succeeded

ARGS = stage_args("pretrain", {"shards": "s3://b/shards", "model": "s3://b/model"}, preset="gpt2-124m")
RUN = "run-0c2f8e6d"


@pytest.fixture
def server():
    with K8sApiServer(max_lifetime_s=30) as srv:
        yield srv


@pytest.fixture
def api(server):
    cfg = kubernetes.client.Configuration()
    cfg.host = server.url
    with kubernetes.client.ApiClient(cfg) as client:
        yield client


def manifest(backend: str = "trainjob", task: str = "pretrain") -> dict:
    cfg = LaunchConfig(backend=backend, num_nodes=2, namespace="lmforge")
    return build_job(cfg, ARGS, image="img", run_id=RUN, task=task)


def pods(name: str, n: int = 2, phase: str = "Running", lines: int = 3) -> list[Pod]:
    return [Pod(f"{name}-node-0-{i}", phase, [f"rank{i} step {s}" for s in range(lines)]) for i in range(n)]


def _watches(server: K8sApiServer) -> list[dict]:
    return [r for r in server.calls("GET") if r["query"].get("watch") == "True"]


@pytest.mark.parametrize("backend", ["trainjob", "pytorchjob"])
def test_submit_watch_succeed_streams_every_pods_log(backend, server, api):
    job = manifest(backend)
    name, kind = job["metadata"]["name"], job["kind"]
    server.script(name, [created(kind), running(kind, pods(name)), succeeded(kind, pods(name, phase="Succeeded"))])
    seen: list[tuple[str, str]] = []

    result = launch_and_wait(job, api_client=api, watch_window_s=5, on_log=lambda pod, line: seen.append((pod, line)))

    assert (result.name, result.kind, result.adopted) == (name, kind, False)
    assert any(c["type"] in ("Complete", "Succeeded") and c["status"] == "True" for c in result.conditions)
    assert sorted(seen) == sorted((p.name, line) for p in pods(name) for line in p.log)
    assert result.log_tail[f"{name}-node-0-1"] == ["rank1 step 0", "rank1 step 1", "rank1 step 2"]
    (post,) = server.calls("POST")
    assert post["body"] == job
    watch = _watches(server)[0]["query"]
    assert watch["fieldSelector"] == f"metadata.name={name}" and watch["resourceVersion"]
    container = "node" if backend == "trainjob" else "pytorch"
    assert {r["query"]["container"] for r in server.calls("GET", "/log")} == {container}
    selector = {r["query"]["labelSelector"] for r in server.calls("GET", "/pods") if "/log" not in r["path"]}
    label = "jobset.sigs.k8s.io/jobset-name" if backend == "trainjob" else "training.kubeflow.org/job-name"
    assert selector == {f"{label}={name}"}
    assert server.job(result.kind.lower() + "s", "lmforge", name) is not None  # kept unless delete_on_success


def test_retried_step_adopts_the_running_job_without_a_second_post(server, api):
    job = manifest("pytorchjob")
    name, kind = job["metadata"]["name"], job["kind"]
    server.seed(job, [running(kind, pods(name, lines=200)), succeeded(kind)])

    result = launch_and_wait(job, api_client=api, watch_window_s=5, log_tail_lines=10)

    assert result.adopted
    assert server.calls("POST") == []
    # Adopting replays only the tail of the running pods' logs, not hours of them.
    assert {r["query"].get("tailLines") for r in server.calls("GET", "/log")} == {"10"}
    assert result.log_tail[f"{name}-node-0-0"][-1] == "rank0 step 199"


def test_a_create_conflict_from_a_concurrent_attempt_is_adopted(server, api, monkeypatch):
    job = manifest()
    server.seed(job, [succeeded(job["kind"])])
    real_get = client_module._Launch.get
    gets: list[str] = []

    def first_get_misses(self):  # the other attempt creates the job between our GET and our POST
        gets.append(self.name)
        return None if len(gets) == 1 else real_get(self)

    monkeypatch.setattr(client_module._Launch, "get", first_get_misses)
    result = launch_and_wait(job, api_client=api, watch_window_s=5)

    assert result.adopted and len(server.calls("POST")) == 1  # answered 409, then adopted


def test_failure_raises_with_the_condition_message_and_last_log_lines(server, api):
    job = manifest()
    name, kind = job["metadata"]["name"], job["kind"]
    crashed = [
        Pod(f"{name}-node-0-0", "Failed", [f"step {s} loss 3.2" for s in range(97)] + ["Traceback", "CUDA error"]),
        Pod(f"{name}-node-0-1", "Succeeded", ["worker fine"]),
    ]
    server.script(name, [created(kind), running(kind, pods(name)), failed(kind, "jobset failed: node-0", crashed)])

    with pytest.raises(LaunchError) as info:
        launch_and_wait(job, api_client=api, watch_window_s=5, log_tail_lines=5)

    message = str(info.value)
    assert f"TrainJob lmforge/{name} failed: JobSetFailed: jobset failed: node-0" in message
    assert f"last 5 log lines of pod {name}-node-0-0" in message
    assert message.endswith("step 94 loss 3.2\nstep 95 loss 3.2\nstep 96 loss 3.2\nTraceback\nCUDA error")
    assert "step 93 loss" not in message and "worker fine" not in message  # the failed pod's lines only
    assert server.calls("DELETE") == []  # a failed job stays for inspection


def test_sigterm_while_waiting_deletes_the_job(server, api):
    job = manifest()
    name, kind = job["metadata"]["name"], job["kind"]
    # The pipeline run is cancelled once the job runs: the step's pod gets SIGTERM.
    server.script(
        name, [created(kind), running(kind, pods(name), on_enter=lambda: os.kill(os.getpid(), signal.SIGTERM))]
    )
    before = signal.getsignal(signal.SIGTERM)

    with pytest.raises(LaunchCancelled, match="SIGTERM"):
        launch_and_wait(job, api_client=api, watch_window_s=5)

    (delete,) = server.calls("DELETE")
    assert delete["path"].endswith(f"/trainjobs/{name}")
    assert server.job("trainjobs", "lmforge", name) is None
    assert signal.getsignal(signal.SIGTERM) is before


def test_keyboard_interrupt_while_waiting_deletes_the_job(server, api):
    job = manifest("pytorchjob")
    name, kind = job["metadata"]["name"], job["kind"]
    server.script(
        name, [created(kind), running(kind, pods(name), on_enter=lambda: os.kill(os.getpid(), signal.SIGINT))]
    )

    with pytest.raises(KeyboardInterrupt):
        launch_and_wait(job, api_client=api, watch_window_s=5)

    assert len(server.calls("DELETE")) == 1 and server.job("pytorchjobs", "lmforge", name) is None


def test_watch_resumes_from_the_last_resource_version_and_after_410_gone(server, api):
    job = manifest()
    name, kind = job["metadata"]["name"], job["kind"]
    server.close_watch_after(name, 1)  # every watch ends after one event, as a server-side timeout would
    first = created(kind)
    first.on_enter = lambda: server.expire_next_watch(name)  # ... and the next one finds its version compacted
    server.script(name, [first, running(kind, pods(name)), succeeded(kind)])

    launch_and_wait(job, api_client=api, watch_window_s=5)

    versions = [int(w["query"]["resourceVersion"]) for w in _watches(server)]
    gets = [r for r in server.calls("GET", f"/trainjobs/{name}")]
    assert len(versions) >= 4 and versions == sorted(versions)
    # Watch 1 from the created object, watch 2 (410) from the Created event, watch 3 after a fresh GET.
    assert versions[1] > versions[0] and versions[2] == versions[1] and len(gets) == 2


def test_a_failed_job_from_an_earlier_attempt_is_replaced(server, api):
    job = manifest()
    name, kind = job["metadata"]["name"], job["kind"]
    server.seed(job, [failed(kind, "preempted", pods(name, phase="Failed"))])
    server.script(name, [created(kind), succeeded(kind)])

    result = launch_and_wait(job, api_client=api, watch_window_s=5)

    assert not result.adopted
    assert [r["method"] for r in server.requests if r["method"] in ("POST", "DELETE")] == ["DELETE", "POST"]
    assert server.calls("DELETE")[0]["body"]["propagationPolicy"] == "Foreground"


def test_timeout_deletes_the_job(server, api):
    job = manifest()
    name, kind = job["metadata"]["name"], job["kind"]
    server.script(name, [created(kind), running(kind, pods(name))])  # runs forever

    with pytest.raises(LaunchTimeout, match="did not finish within 1 s"):
        launch_and_wait(job, api_client=api, watch_window_s=1, timeout_s=1)

    assert len(server.calls("DELETE")) == 1


def test_launch_builds_from_config_and_deletes_on_success_when_asked(server, api):
    cfg = LaunchConfig(num_nodes=2, namespace="lmforge", delete_on_success=True, watch_window_s=5)
    job = build_job(cfg, ARGS, image="img", run_id=RUN, task="distill")
    name, kind = job["metadata"]["name"], job["kind"]
    server.script(name, [created(kind), succeeded(kind, pods(name, phase="Succeeded"))])

    result = launch(cfg, ARGS, image="img", run_id=RUN, task="distill", api_client=api)

    assert result.name == name and server.calls("POST")[0]["body"] == job
    assert server.job("trainjobs", "lmforge", name) is None


def test_a_job_deleted_by_someone_else_is_an_error(server, api):
    job = manifest()
    name, kind = job["metadata"]["name"], job["kind"]

    def delete_it():
        server.remove("trainjobs", "lmforge", name)

    server.script(name, [created(kind), running(kind, pods(name), on_enter=delete_it)])
    with pytest.raises(LaunchError, match="was deleted while running"):
        launch_and_wait(job, api_client=api, watch_window_s=5)


@pytest.mark.parametrize(("release", "field"), [("v2.1.0", "podTemplateOverrides"), ("v2.3.0", "runtimePatches")])
def test_launch_places_pods_with_the_field_the_clusters_trainer_serves(release, field):
    """Kubeflow 1.11 ships Trainer v2.1 (podTemplateOverrides); v2.2+ has runtimePatches. The launcher reads which
    from the API server's OpenAPI v3 document and creates strictly, so nothing is pruned from the job."""
    cfg = LaunchConfig(num_nodes=2, namespace="lmforge", watch_window_s=5)
    with K8sApiServer(max_lifetime_s=30, trainer_version=release) as server:
        api_cfg = kubernetes.client.Configuration()
        api_cfg.host = server.url
        with kubernetes.client.ApiClient(api_cfg) as api:
            name = build_job(cfg, ARGS, image="img", run_id=RUN, task="pretrain")["metadata"]["name"]
            server.script(name, [created("TrainJob"), succeeded("TrainJob", pods(name, phase="Succeeded"))])
            launch(cfg, ARGS, image="img", run_id=RUN, task="pretrain", api_client=api)
        (post,) = server.calls("POST")
        assert post["query"]["fieldValidation"] == "Strict"
        assert field in post["body"]["spec"] and server.pruned == []
        assert server.calls("GET", "/openapi/v3/apis/trainer.kubeflow.org/v1alpha1")
        stored = server.job("trainjobs", "lmforge", name)
        (override,) = stored["spec"][field]
        pod = override["spec"] if field == "podTemplateOverrides" else override["trainingRuntimeSpec"]["template"]
        assert "lmforge-worker" in str(pod) and "lmforge.io/pool" in str(pod)  # placement and account kept


@pytest.mark.parametrize("runtime_kind", ["ClusterTrainingRuntime", "TrainingRuntime"])
def test_a_runtime_the_cluster_lacks_fails_the_create_saying_how_to_install_or_name_one(runtime_kind):
    """lmforge's runtimes by default, on a cluster that has only the stock ones: Trainer's webhook refuses the
    TrainJob; the error keeps its message and says what to do. Naming a stock runtime then creates the job."""
    cfg = LaunchConfig(num_nodes=2, namespace="lmforge", runtime_kind=runtime_kind)
    with K8sApiServer(max_lifetime_s=30, runtimes={"torch-distributed", "deepspeed-distributed"}) as server:
        api_cfg = kubernetes.client.Configuration()
        api_cfg.host = server.url
        with kubernetes.client.ApiClient(api_cfg) as api:
            with pytest.raises(LaunchError) as err:
                launch(cfg, ARGS, image="img", run_id=RUN, task="pretrain", api_client=api)
            message = str(err.value)
            assert '"lmforge-torch-distributed" not found' in message and "HTTP 403" in message
            assert "kubectl apply -k manifests/trainer-runtimes" in message and "launch.runtime_name" in message
            stock = cfg.model_copy(update={"runtime_name": "torch-distributed"})
            name = build_job(stock, ARGS, image="img", run_id=RUN, task="pretrain")["metadata"]["name"]
            assert server.job("trainjobs", "lmforge", name) is None
            server.script(name, [created("TrainJob"), succeeded("TrainJob", pods(name, phase="Succeeded"))])
            launch(stock, ARGS, image="img", run_id=RUN, task="pretrain", api_client=api)
        assert server.job("trainjobs", "lmforge", name)["spec"]["runtimeRef"]["name"] == "torch-distributed"


def test_a_field_the_clusters_crd_lacks_fails_the_create_instead_of_being_pruned():
    """Forced runtimePatches on a Trainer v2.1 cluster: strict field validation turns silent pruning into an error."""
    cfg = LaunchConfig(num_nodes=2, namespace="lmforge", trainjob_pod_overrides="runtimePatches")
    with K8sApiServer(max_lifetime_s=30, trainer_version="v2.1.0") as server:
        api_cfg = kubernetes.client.Configuration()
        api_cfg.host = server.url
        with kubernetes.client.ApiClient(api_cfg) as api, pytest.raises(LaunchError) as err:
            launch(cfg, ARGS, image="img", run_id=RUN, task="pretrain", api_client=api)
        assert 'strict decoding error: unknown field "spec.runtimePatches"' in str(err.value)
        assert (
            server.job(
                "trainjobs", "lmforge", build_job(cfg, ARGS, image="i", run_id=RUN, task="pretrain")["metadata"]["name"]
            )
            is None
        )


def _launch(window_s: int = 30) -> client_module._Launch:
    return client_module._Launch(
        manifest(), kubernetes.client.ApiClient(), watch_window_s=window_s, log_tail_lines=5, on_log=None
    )


def test_a_watch_window_is_cut_to_the_time_left_and_the_deadline_raises(monkeypatch):
    monkeypatch.setattr(client_module.time, "monotonic", lambda: 100.0)
    launch = _launch(window_s=30)
    assert launch._window(None) == 30
    assert launch._window(200.0) == 30
    assert launch._window(102.5) == 3  # the whole seconds left, plus one
    assert launch._window(100.2) == 1
    with pytest.raises(client_module._Timeout):
        launch._window(100.0)


def test_a_watch_event_carries_the_job_except_a_bookmark_and_a_deletion_raises():
    launch = _launch()
    job = {"metadata": {"name": "j", "resourceVersion": "7"}}
    assert launch._job_of({"type": "MODIFIED", "raw_object": job}) is job
    assert launch._job_of({"type": "BOOKMARK", "raw_object": {"metadata": {"resourceVersion": "8"}}}) is None
    with pytest.raises(LaunchError, match="was deleted while running"):
        launch._job_of({"type": "DELETED", "raw_object": job})


def test_a_broken_watch_connection_backs_off_exponentially_then_gives_up(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(client_module.time, "sleep", slept.append)
    launch = _launch()
    error = client_module.TransportError("connection reset")
    for broken in range(1, client_module.MAX_BROKEN_WATCHES):
        launch._back_off(broken, error)
    assert slept == [2.0, 4.0, 8.0, 16.0, 30.0]
    with pytest.raises(LaunchError, match="lost the API server 6 times in a row: connection reset"):
        launch._back_off(client_module.MAX_BROKEN_WATCHES, error)
