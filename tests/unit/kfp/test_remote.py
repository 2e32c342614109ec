"""``lmforge submit|schedule|runs`` through the real ``kfp.Client`` against a KFP-API-shaped server on loopback.

The server is tests/fakes/kfp_api_server.py, an in-memory stand-in for the KFP v2beta1 REST API (no real KFP API
server runs here), so these tests pin what lmforge sends and how it reacts, not how a real cluster behaves.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import textwrap
from pathlib import Path

import kfp
import pytest
from typer.testing import CliRunner

from lmforge import __version__
from lmforge.cli import application
from lmforge.errors import LmforgeError
from lmforge_kfp.pipelines.remote import COMPILED_PIPELINE, kfp_cron, load_package, pipeline_arguments
from tests.fakes.kfp_api_server import KfpApiServer

runner = CliRunner()


TOKEN = "t0k3n-for-the-stand-in"


@pytest.fixture
def server(monkeypatch, tmp_path):
    """A multi-user (profile namespaces, bearer tokens) stand-in, with the namespace and token in the environment
    as a CI job would set them; kfp's per-user context file is kept out of the test."""
    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json"))
    monkeypatch.setenv("LMFORGE_KFP_NAMESPACE", "lmforge")
    monkeypatch.setenv("LMFORGE_KFP_TOKEN", TOKEN)
    monkeypatch.delenv("KF_PIPELINES_SA_TOKEN_PATH", raising=False)
    with KfpApiServer(multi_user=True, token=TOKEN, lifetime_s=60) as api:
        yield api


@pytest.fixture
def package(tmp_path) -> Path:
    """A copy of the compiled lmforge pipeline that a test may change to make a new pipeline version."""
    return Path(shutil.copy(COMPILED_PIPELINE, tmp_path / "lmforge_pipeline.yaml"))


def _version_name(path: Path) -> str:
    return f"{__version__}-{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}"


def _error_line(result) -> str:
    """The single ``error:`` line, which must be the last line of the output."""
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == [lines[-1]], result.output
    return errors[0]


def _schedule(server: KfpApiServer, package: Path, *extra: str):
    args = ["schedule", "--host", server.url, "--cron", "0 3 * * 0", "--name", "weekly", "--package", str(package)]
    return runner.invoke(application(), [*args, *extra])


# -- submit ------------------------------------------------------------------------------------------------------------


def test_submit_uploads_the_pipeline_creates_experiment_and_run_and_prints_the_run_url(server, package):
    result = runner.invoke(
        application(),
        [
            "submit",
            "--host",
            server.url,
            "--package",
            str(package),
            "--set",
            "pretrain.train.max_steps=40",
            "--param",
            "release_version=1.10",
            "--experiment",
            "nightly",
        ],
    )
    assert result.exit_code == 0, result.output

    [pipeline] = server.pipelines.values()
    assert pipeline["name"] == "lmforge"
    version = next(v for v in server.versions.values() if v["name"] == _version_name(package))
    [experiment] = server.experiments.values()
    assert (experiment["display_name"], experiment["namespace"]) == ("nightly", "lmforge")
    [run] = server.runs.values()
    assert run["experiment_id"] == experiment["experiment_id"]
    assert run["pipeline_version_reference"] == {
        "pipeline_id": pipeline["pipeline_id"],
        "pipeline_version_id": version["pipeline_version_id"],
    }
    assert run.get("service_account", "") == ""  # the server's default account (pipeline-runner / default-editor)
    assert run["runtime_config"]["parameters"] == {
        "preset": "tiny-cpu",
        "pretrain_overrides": json.dumps({"train.max_steps": 40}),
        "release_version": "1.10",  # a STRING parameter keeps its text, not the float 1.1
    }
    assert result.stdout.splitlines()[-1] == f"{server.url}/#/runs/details/{run['run_id']}"


def test_submitting_the_same_pipeline_twice_uploads_it_once(server, package):
    for _ in range(2):
        result = runner.invoke(application(), ["submit", "--host", server.url, "--package", str(package)])
        assert result.exit_code == 0, result.output
    assert len(server.calls("POST", "/pipelines/upload")) == 1
    assert len(server.calls("POST", "/pipelines/upload_version")) == 1
    assert len(server.runs) == 2
    assert len(server.experiments) == 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--set", "pretrain.train.max_steps=true"], "pretrain.train.max_steps"),
        (["--set", "pretrian.train.lr=0.1"], "pretrian.train.lr"),
        (["--param", "no_such_parameter=1"], "--param no_such_parameter"),
        (["--param", "preset=gpt2-124m"], "--param preset: set it with --preset"),
        (["--param", "pretrain_overrides={}"], "--set pretrain.FIELD=VALUE"),
        (["--param", "release_version"], "expected KEY=VALUE"),
        (["--preset", "gpt-9"], "unknown preset 'gpt-9'"),
    ],
)
def test_submit_rejects_bad_input_before_contacting_the_server(server, package, extra, message):
    result = runner.invoke(application(), ["submit", "--host", server.url, "--package", str(package), *extra])
    assert message in _error_line(result)
    assert server.requests == []


def test_submit_rejects_a_host_without_scheme(server):
    result = runner.invoke(application(), ["submit", "--host", server.url.removeprefix("http://")])
    assert "expected a URL starting with http://" in _error_line(result)
    assert server.requests == []


# -- schedule ----------------------------------------------------------------------------------------------------------


def test_second_schedule_with_the_same_name_moves_it_to_the_new_pipeline_version(server, package):
    first = _schedule(server, package)
    assert first.exit_code == 0, first.output
    [old] = server.recurring_runs_named("weekly")
    assert old["trigger"] == {"cron_schedule": {"cron": "0 0 3 * * 0"}}  # KFP's seconds-first form
    assert (old.get("service_account", ""), old["max_concurrency"], old["no_catchup"]) == ("", 1, True)

    package.write_text(package.read_text() + "# a change to the pipeline\n")  # new content, new version
    second = _schedule(server, package)
    assert second.exit_code == 0, second.output

    [new] = server.recurring_runs_named("weekly")
    newest = next(v for v in server.versions.values() if v["name"] == _version_name(package))
    assert new["pipeline_version_reference"]["pipeline_version_id"] == newest["pipeline_version_id"]
    assert new["recurring_run_id"] != old["recurring_run_id"]
    assert f"replaced {old['recurring_run_id']}" in second.output
    assert second.stdout.splitlines()[-1] == f"{server.url}/#/recurringrun/details/{new['recurring_run_id']}"
    # Safe order: the new recurring run exists before the old one is deleted.
    order = [(r.method, r.path) for r in server.requests if "/recurringruns" in r.path and r.method != "GET"]
    assert order[-2:] == [
        ("POST", "/apis/v2beta1/recurringruns"),
        ("DELETE", f"/apis/v2beta1/recurringruns/{old['recurring_run_id']}"),
    ]


def test_schedule_with_nothing_changed_leaves_the_recurring_run_alone(server, package):
    assert _schedule(server, package).exit_code == 0
    [before] = server.recurring_runs_named("weekly")
    writes = len([r for r in server.requests if r.method != "GET"])

    again = _schedule(server, package)
    assert again.exit_code == 0, again.output
    assert "unchanged" in again.output
    assert server.recurring_runs_named("weekly") == [before]
    assert len([r for r in server.requests if r.method != "GET"]) == writes


def test_schedule_with_new_parameters_replaces_the_recurring_run(server, package):
    assert _schedule(server, package).exit_code == 0
    changed = _schedule(server, package, "--param", "release_root=s3://other/releases")
    assert changed.exit_code == 0, changed.output
    [current] = server.recurring_runs_named("weekly")
    assert current["runtime_config"]["parameters"]["release_root"] == "s3://other/releases"


def test_schedule_collapses_duplicate_recurring_runs_of_one_name(server, package):
    assert _schedule(server, package).exit_code == 0
    [original] = server.recurring_runs_named("weekly")
    server.recurring_runs["recurring-dup"] = {**original, "recurring_run_id": "recurring-dup"}  # made by hand

    package.write_text(package.read_text() + "# v2\n")
    assert _schedule(server, package).exit_code == 0
    [only] = server.recurring_runs_named("weekly")
    assert only["recurring_run_id"] not in (original["recurring_run_id"], "recurring-dup")


def test_schedule_keeps_the_old_recurring_run_when_creating_the_new_one_fails(server, package):
    assert _schedule(server, package).exit_code == 0
    [old] = server.recurring_runs_named("weekly")
    package.write_text(package.read_text() + "# v2\n")
    server.fail_with(500, "POST", "/apis/v2beta1/recurringruns")

    line = _error_line(_schedule(server, package))
    assert line.startswith(f"error: {server.url}: create recurring run 'weekly' failed: HTTP 500")
    assert server.recurring_runs_named("weekly") == [old]


def test_schedule_names_the_old_recurring_run_it_could_not_delete(server, package):
    assert _schedule(server, package).exit_code == 0
    [old] = server.recurring_runs_named("weekly")
    package.write_text(package.read_text() + "# v2\n")
    server.fail_with(503, "DELETE")

    line = _error_line(_schedule(server, package))
    new_id = next(r["recurring_run_id"] for r in server.recurring_runs_named("weekly") if r != old)
    assert f"created as {new_id}" in line
    assert f"old one(s) {old['recurring_run_id']} could not be deleted" in line


def test_schedule_rejects_a_bad_cron_before_contacting_the_server(server, package):
    result = runner.invoke(
        application(),
        ["schedule", "--host", server.url, "--cron", "every sunday", "--name", "w", "--package", str(package)],
    )
    assert "--cron 'every sunday'" in _error_line(result)
    assert server.requests == []


# -- failing server answers --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "method", "path", "operation"),
    [
        (500, "POST", "/apis/v2beta1/runs", "create run"),
        (404, "GET", "/apis/v2beta1/pipelines", "find pipeline 'lmforge'"),
        (403, "POST", "/apis/v2beta1/pipelines/upload", "upload pipeline 'lmforge'"),
        (500, "GET", "/apis/v2beta1/experiments", "get or create experiment 'lmforge'"),
    ],
)
def test_a_failing_server_answer_is_one_line_naming_host_and_operation(
    server, package, status, method, path, operation
):
    server.fail_with(status, method, path)
    line = _error_line(runner.invoke(application(), ["submit", "--host", server.url, "--package", str(package)]))
    assert line.startswith(f"error: {server.url}: {operation}")
    assert f"failed: HTTP {status}" in line
    assert f"injected failure for {method} {path}" in line  # the server's own message is passed on


def test_an_unreachable_host_is_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json"))
    with KfpApiServer() as stopped:
        url = stopped.url
    line = _error_line(runner.invoke(application(), ["runs", "--host", url]))
    assert line.startswith(f"error: {url}: ") and "failed: cannot reach the server" in line
    assert "Connection refused" in line


# -- runs --------------------------------------------------------------------------------------------------------------


def test_runs_lists_the_most_recent_runs_with_their_state(server, package):
    for name in ("first", "second", "third"):
        result = runner.invoke(
            application(), ["submit", "--host", server.url, "--package", str(package), "--run-name", name]
        )
        assert result.exit_code == 0, result.output
    for run in server.runs.values():
        run["state"] = {"first": "FAILED", "second": "SUCCEEDED", "third": "RUNNING"}[run["display_name"]]

    result = runner.invoke(application(), ["runs", "--host", server.url, "--limit", "2"])
    assert result.exit_code == 0, result.output
    assert "third" in result.stdout and "RUNNING" in result.stdout
    assert "second" in result.stdout and "SUCCEEDED" in result.stdout
    assert "first" not in result.stdout
    [request] = server.calls("GET", "/runs")
    assert (request.query["page_size"], request.query["sort_by"], request.query["namespace"]) == (
        "2",
        "created_at desc",
        "lmforge",
    )


# -- local pieces ------------------------------------------------------------------------------------------------------


def test_kfp_cron_adds_the_seconds_field_to_a_standard_expression():
    assert kfp_cron("0 3 * * 0") == "0 0 3 * * 0"
    assert kfp_cron("30 0 3 * * 0") == "30 0 3 * * 0"
    with pytest.raises(LmforgeError, match="expected 5 fields"):
        kfp_cron("0 3 * *")


def test_pipeline_arguments_are_converted_to_the_declared_parameter_types(tmp_path):
    spec = tmp_path / "p.yaml"
    spec.write_text(
        textwrap.dedent(
            """\
            pipelineInfo: {name: demo}
            root:
              inputDefinitions:
                parameters:
                  preset: {parameterType: STRING}
                  pretrain_overrides: {parameterType: STRING}
                  version: {parameterType: STRING}
                  count: {parameterType: NUMBER_INTEGER}
                  ratio: {parameterType: NUMBER_DOUBLE}
                  enabled: {parameterType: BOOLEAN}
                  selector: {parameterType: STRUCT}
                  tolerations: {parameterType: LIST}
            """
        )
    )
    package = load_package(spec)
    raw = {
        "version": "1.10",
        "count": "2",
        "ratio": "0.5",
        "enabled": "TRUE",
        "selector": '{"pool": "gpu"}',
        "tolerations": '[{"key": "nvidia.com/gpu"}]',
    }
    assert pipeline_arguments(package, "tiny-cpu", {"pretrain": {"train.lr": 0.001}}, raw) == {
        "preset": "tiny-cpu",
        "pretrain_overrides": '{"train.lr": 0.001}',
        "version": "1.10",
        "count": 2,
        "ratio": 0.5,
        "enabled": True,
        "selector": {"pool": "gpu"},
        "tolerations": [{"key": "nvidia.com/gpu"}],
    }
    for name, value, message in [
        ("count", "two", "expected number_integer"),
        ("selector", "[1]", "expected a JSON object"),
        ("enabled", "yes", "expected true or false"),
    ]:
        with pytest.raises(LmforgeError, match=message):
            pipeline_arguments(package, "tiny-cpu", {}, {name: value})
    with pytest.raises(LmforgeError, match="recompile"):
        pipeline_arguments(package, "tiny-cpu", {"clean": {"min_words": 3}}, {})


# -- authentication and single-user defaults ---------------------------------------------------------------------------


def test_a_multi_user_server_without_credentials_fails_in_one_line_saying_how_to_authenticate(
    server, package, monkeypatch
):
    monkeypatch.delenv("LMFORGE_KFP_TOKEN")
    line = _error_line(runner.invoke(application(), ["submit", "--host", server.url, "--package", str(package)]))
    assert "HTTP 401" in line and "there is no user identity header" in line
    assert "--token" in line and "KF_PIPELINES_SA_TOKEN_PATH" in line
    assert not server.runs


def test_a_service_account_token_file_authenticates(server, package, monkeypatch, tmp_path):
    """What a pod or CI runner with a projected token (audience pipelines.kubeflow.org) does: kfp's own variable."""
    monkeypatch.delenv("LMFORGE_KFP_TOKEN")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(token_file))
    result = runner.invoke(application(), ["runs", "--host", server.url])
    assert result.exit_code == 0, result.output
    assert server.requests and all(r.path.endswith("healthz") or r.method for r in server.requests)


def test_single_user_defaults_send_no_namespace_and_no_service_account(monkeypatch, tmp_path, package):
    """Single-user KFP runs in `kubeflow` as pipeline-runner; naming another account (or namespace) breaks the run."""
    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json"))
    for name in ("LMFORGE_KFP_NAMESPACE", "LMFORGE_KFP_TOKEN", "KF_PIPELINES_SA_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    with KfpApiServer(lifetime_s=60) as single_user:
        result = runner.invoke(application(), ["submit", "--host", single_user.url, "--package", str(package)])
        assert result.exit_code == 0, result.output
        [run] = single_user.runs.values()
        [experiment] = single_user.experiments.values()
    assert run.get("service_account", "") == "" and experiment["namespace"] == ""
