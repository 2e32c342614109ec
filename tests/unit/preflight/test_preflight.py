"""Preflight checks fail fast with a reason per check; fingerprints follow the data, not the URI."""

import hashlib
import json

import pytest
import yaml
from kfp import dsl

from lmforge import storage
from lmforge.preflight.preflight import PreflightError, check_writable, fingerprint_uri, run_checks
from lmforge_kfp.pipelines.compile import REPO_ROOT


def _corpus(tmp_path, text="a document with enough words in it\n"):
    path = tmp_path / "corpus"
    path.mkdir(exist_ok=True)
    (path / "a.jsonl").write_text(json.dumps({"text": text}) + "\n")
    return path


def test_fingerprint_is_stable_for_the_same_bytes_and_changes_with_one_byte(tmp_path):
    corpus = _corpus(tmp_path)
    first = fingerprint_uri(str(corpus))
    assert fingerprint_uri(str(corpus)) == first
    data = bytearray((corpus / "a.jsonl").read_bytes())
    data[12] ^= 0x01
    (corpus / "a.jsonl").write_bytes(bytes(data))
    assert fingerprint_uri(str(corpus)) != first


def test_fingerprint_of_a_demo_corpus_is_deterministic():
    assert fingerprint_uri("demo://chatterbot") == fingerprint_uri("demo://chatterbot")


def test_run_checks_lists_every_failure_in_one_message(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(PreflightError) as err:
        run_checks(
            corpus_uri=str(tmp_path / "missing.jsonl"),
            qa_uri="demo://chatterbot",
            release_root=str(blocker / "registry"),
            s3_secret_name="lmforge-s3",
        )
    message = str(err.value)
    assert "corpus_readable" in message and "missing.jsonl" in message
    assert "release_root_writable" in message
    assert "qa_readable" not in message
    assert "\n" not in message


def test_run_checks_passes_and_leaves_no_probe_behind(tmp_path):
    corpus = _corpus(tmp_path)
    report = run_checks(
        corpus_uri=str(corpus), qa_uri="demo://chatterbot", release_root=str(tmp_path / "reg"), s3_secret_name=""
    )
    assert not report.failed
    assert set(report.fingerprints) == {"corpus", "qa"}
    assert not [p for p in (tmp_path / "reg").rglob("*") if p.is_file()]


@pytest.mark.s3
def test_s3_fingerprint_and_writability(s3_env):
    base = f"s3://{s3_env}/raw"
    storage.write_bytes(f"{base}/a.jsonl", b'{"text": "one"}\n')
    first = fingerprint_uri(base)
    assert fingerprint_uri(base) == first
    storage.write_bytes(f"{base}/a.jsonl", b'{"text": "onE"}\n')
    assert fingerprint_uri(base) != first
    check_writable(f"s3://{s3_env}/releases")
    assert storage.list_files(f"s3://{s3_env}/releases") == []


def _cache_keys(spec: dict, params: dict, preflight_outputs: dict) -> dict[str, str]:
    """KFP v2's caching rule applied to the compiled DAG.

    A task's cache key covers its component (image, command, args) and its inputs: parameter values and
    the artifacts it reads, which are identified by the upstream task that produced them. ``preflight``
    is never cached; its outputs are the live fingerprints.
    """
    executors = spec["deploymentSpec"]["executors"]
    keys: dict[str, str] = {}
    dags: set[str] = set()

    def visit(dag: dict, scope: dict) -> None:
        pending = dict(dag["tasks"])
        while pending:
            for name, task in list(pending.items()):
                if not set(task.get("dependentTasks", [])) <= set(keys):
                    continue
                inputs = task.get("inputs", {})
                resolved = {}
                for pname, p in inputs.get("parameters", {}).items():
                    if "componentInputParameter" in p:
                        resolved[pname] = scope[p["componentInputParameter"]]
                    elif "taskOutputParameter" in p:
                        producer = p["taskOutputParameter"]["producerTask"]
                        key = p["taskOutputParameter"]["outputParameterKey"]
                        resolved[pname] = (
                            preflight_outputs[key] if producer == "preflight" else f"{keys[producer]}/{key}"
                        )
                    else:
                        resolved[pname] = p.get("runtimeValue", {}).get("constant")
                for aname, a in inputs.get("artifacts", {}).items():
                    if "componentInputArtifact" in a:
                        resolved[aname] = scope[a["componentInputArtifact"]]
                    else:
                        producer = a["taskOutputArtifact"]["producerTask"]
                        resolved[aname] = f"{keys[producer]}/{a['taskOutputArtifact']['outputArtifactKey']}"
                component = spec["components"][task["componentRef"]["name"]]
                if "dag" in component:  # a condition or loop: its key covers its inputs, its tasks are keyed inside
                    if iterator := task.get("parameterIterator"):
                        resolved[iterator["itemInput"]] = f"{resolved[iterator['items']['inputParameter']]}[item]"
                    keys[name] = hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest()
                    dags.add(name)
                    visit(component["dag"], {**scope, **resolved})
                else:
                    container = executors[component["executorLabel"]]["container"]
                    blob = json.dumps({"container": container, "inputs": resolved}, sort_keys=True)
                    keys[name] = hashlib.sha256(blob.encode()).hexdigest()
                del pending[name]

    visit(spec["root"]["dag"], params)
    return {k: v for k, v in keys.items() if k not in dags}


PREFLIGHT_OUTPUTS = {
    "corpus_fingerprint": "c",
    "qa_fingerprint": "q",
    "production_fingerprint": "p",
    "gpu_limit": "1",
    "model_name": "demo",
    "base_model_fingerprint": "",
    "student_base_fingerprint": "",
    "run_root": "s3://lmforge/releases",
    "plan": '{"stages": []}',
}


def test_a_new_production_release_changes_the_cache_key_of_evaluate(tmp_path):
    """A scheduled run after a new release must re-run the gate against it, not reuse the old decision."""
    from lmforge.release.catalog import production_fingerprint

    spec = next(yaml.safe_load_all((REPO_ROOT / "pipelines/compiled/lmforge_pipeline.yaml").read_text()))
    params = {name: p.get("defaultValue") for name, p in spec["root"]["inputDefinitions"]["parameters"].items()}
    root = str(tmp_path / "registry")
    none_yet = production_fingerprint(root, "demo")
    assert production_fingerprint(root, "demo") == none_yet
    before = _cache_keys(spec, params, {**PREFLIGHT_OUTPUTS, "production_fingerprint": none_yet})
    (tmp_path / "registry" / "models" / "demo" / "v1").mkdir(parents=True)
    (tmp_path / "registry" / "models" / "demo" / "v1" / "manifest.json").write_text(
        json.dumps({"kind": "release", "version": "v1", "created_at": "2026-12-01T00:00:00Z", "evaluation": {}})
    )
    after_release = production_fingerprint(root, "demo")
    assert after_release != none_yet
    after = _cache_keys(spec, params, {**PREFLIGHT_OUTPUTS, "production_fingerprint": after_release})
    changed = {task for task in before if before[task] != after[task]}
    assert changed == {"evaluate", "promote", "serve"}, changed  # serve takes promote's output


def test_the_training_plan_reaches_evaluate_by_value_so_only_a_changed_plan_changes_its_cache_key():
    """A parameter, not an artifact: the never-cached preflight makes a new artifact every run, which would re-key
    evaluate every run; a value re-keys it (and promote and serve, which take its outputs) only when it changes."""
    spec = next(yaml.safe_load_all((REPO_ROOT / "pipelines/compiled/lmforge_pipeline.yaml").read_text()))
    plan_input = spec["root"]["dag"]["tasks"]["evaluate"]["inputs"]["parameters"]["plan"]
    assert plan_input["taskOutputParameter"] == {"outputParameterKey": "plan", "producerTask": "preflight"}
    params = {name: p.get("defaultValue") for name, p in spec["root"]["inputDefinitions"]["parameters"].items()}
    before = _cache_keys(spec, params, PREFLIGHT_OUTPUTS)
    assert _cache_keys(spec, params, dict(PREFLIGHT_OUTPUTS)) == before
    after = _cache_keys(spec, params, {**PREFLIGHT_OUTPUTS, "plan": '{"stages": [{"stage": "pretrain"}]}'})
    assert {task for task in before if before[task] != after[task]} == {"evaluate", "promote", "serve"}


def test_changed_corpus_bytes_change_the_cache_key_of_every_downstream_stage(tmp_path):
    spec = next(yaml.safe_load_all((REPO_ROOT / "pipelines/compiled/lmforge_pipeline.yaml").read_text()))
    params = {name: p.get("defaultValue") for name, p in spec["root"]["inputDefinitions"]["parameters"].items()}
    corpus = _corpus(tmp_path)
    params["corpus_uri"] = str(corpus)

    def keys() -> dict[str, str]:
        outputs = {**PREFLIGHT_OUTPUTS, "corpus_fingerprint": fingerprint_uri(str(corpus))}
        return _cache_keys(spec, params, outputs)

    before, again = keys(), keys()
    assert before == again
    (corpus / "a.jsonl").write_text((corpus / "a.jsonl").read_text().replace("enough", "Enough"))
    after = keys()
    downstream = set(before) - {"preflight", "plan-shards", "plan-dedup"}  # the plans read only their counts
    assert {"clean-shard", "merge-shards", "tokenize", "pretrain", "distill", "evaluate", "promote"} <= downstream
    assert not [task for task in downstream if before[task] == after[task]]


@pytest.mark.parametrize("backend", ["trainjob", "pytorchjob"])
def test_training_api_check_passes_when_the_cluster_serves_the_job_kind(backend):
    import kubernetes

    from lmforge.config import LaunchConfig
    from lmforge.preflight.preflight import check_training_api
    from tests.fakes.k8s_api_server import K8sApiServer

    with K8sApiServer() as server:
        cfg = kubernetes.client.Configuration()
        cfg.host = server.url
        with kubernetes.client.ApiClient(cfg) as api:
            assert check_training_api(LaunchConfig(backend=backend, num_nodes=2), api) == "ok"
        (call,) = server.calls("GET")
        group = "trainer.kubeflow.org/v1alpha1" if backend == "trainjob" else "kubeflow.org/v1"
        assert call["path"] == f"/apis/{group}"  # discovery: readable without cluster-scoped RBAC


def test_training_api_check_names_the_missing_operator():
    import kubernetes

    from lmforge.config import LaunchConfig
    from lmforge.preflight.preflight import check_training_api
    from tests.fakes.k8s_api_server import K8sApiServer

    with K8sApiServer(served=("TrainJob",)) as server:
        cfg = kubernetes.client.Configuration()
        cfg.host = server.url
        with kubernetes.client.ApiClient(cfg) as api:
            verdict = check_training_api(LaunchConfig(backend="pytorchjob"), api)
    assert verdict == (
        "the cluster does not serve kubeflow.org/v1 (PyTorchJob): install the Kubeflow Training Operator v1"
    )


def test_run_checks_skips_the_training_api_for_one_node(tmp_path):
    from lmforge.config import LaunchConfig

    report = run_checks(
        corpus_uri=str(_corpus(tmp_path)), qa_uri="demo://chatterbot", release_root=str(tmp_path / "reg"),
        s3_secret_name="", launch=LaunchConfig(num_nodes=1),
    )  # fmt: skip
    assert "training_job_api" not in report.checks


def test_preflight_component_refuses_a_bad_launch_before_any_gpu_step(tmp_path, capsys):
    from lmforge_kfp.components import load_component

    preflight = load_component("preflight")
    metrics = dsl.Metrics(name="metrics", uri=str(tmp_path / "metrics"), metadata={})
    with pytest.raises(SystemExit) as exited:
        preflight.python_func(
            corpus_uri=str(_corpus(tmp_path)), qa_uri="demo://chatterbot", release_root=str(tmp_path / "reg"),
            metrics=metrics, s3_secret_name="", launch='{"num_node": 2}',
        )  # fmt: skip
    assert exited.value.code == 2  # an input error: one line, no traceback
    last = capsys.readouterr().err.strip().splitlines()[-1]  # the component's log: error line last
    assert "error: " in last and "launch.num_node: Extra inputs are not permitted" in last


def test_the_pipeline_passes_its_launch_parameter_to_preflight():
    spec = next(yaml.safe_load_all((REPO_ROOT / "pipelines/compiled/lmforge_pipeline.yaml").read_text()))
    task = spec["root"]["dag"]["tasks"]["preflight"]
    assert task["inputs"]["parameters"]["launch"] == {"componentInputParameter": "launch"}


def test_the_checks_run_in_order_and_an_unreadable_production_release_names_its_source(tmp_path, monkeypatch):
    from lmforge.errors import StorageError
    from lmforge.release import catalog

    corpus, root = _corpus(tmp_path), str(tmp_path / "reg")
    report = run_checks(
        corpus_uri=str(corpus), qa_uri="demo://chatterbot", release_root=root, s3_secret_name="", model_name="demo"
    )
    assert list(report.checks) == [
        "s3_secret",
        "corpus_readable",
        "corpus_sample",
        "qa_readable",
        "qa_sample",
        "release_root_writable",
        "release_root_conditional_writes",
        "production_release_readable",
    ]

    def unreadable(release_root: str, model_name: str, source: str) -> str:
        raise StorageError(f"cannot read the {source} release")

    monkeypatch.setattr(catalog, "production_fingerprint", unreadable)
    with pytest.raises(PreflightError) as err:
        run_checks(
            corpus_uri=str(corpus), qa_uri="demo://chatterbot", release_root=root, s3_secret_name="", model_name="demo"
        )
    assert (
        str(err.value)
        == f"preflight failed: production_release_readable: {root} (demo): cannot read the registry release"
    )
    with pytest.raises(PreflightError) as err:
        run_checks(
            corpus_uri=str(corpus),
            qa_uri="demo://chatterbot",
            release_root=root,
            s3_secret_name="",
            model_name="demo",
            preset="tiny-cpu",
            stage_overrides={"evaluate": {"production_source": "mlflow"}},
        )
    assert str(err.value) == (
        "preflight failed: production_release_readable: MLflow alias production of demo: cannot read the mlflow release"
    )
