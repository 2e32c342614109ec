"""lmforge.launch manifest builders: validated against the real Kubeflow CRD schemas (tests/data/crds/)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmforge.config import LaunchConfig, SecretEnvConfig, TolerationConfig, validate_config
from lmforge.config.launch import LMFORGE_TRAINER_RUNTIMES
from lmforge.errors import ConfigError
from lmforge.launch import (
    PYTORCHJOB,
    TRAINJOB,
    build_job,
    build_pytorchjob,
    build_trainjob,
    job_name,
    single_pod_command,
    stage_args,
)
from lmforge.launch.manifests import MAX_JOB_NAME, job_command, kind_of
from tests.fakes.k8s_api_server import nodes_and_procs
from tests.support.crd_schema import CRDS, TRAINER_CRDS, load_crd, strict_validator
from tests.support.pod_security import restricted_violations
from tests.support.pods import pytorchjob_pods, trainjob_pods

ARGS = stage_args("pretrain", {"shards": "s3://b/shards", "model": "s3://b/model"}, preset="gpt2-124m")
RFC1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# The TrainJob field each Kubeflow Trainer release places pods with (v2.1 is what Kubeflow 1.11 ships).
POD_OVERRIDES_OF = {"v2.1.0": "podTemplateOverrides", "v2.3.0": "runtimePatches", "main": "runtimePatches"}
# lmforge's ClusterTrainingRuntimes, one file per `launch.runtime`.
LMFORGE_RUNTIMES = Path(__file__).parents[3] / "manifests" / "trainer-runtimes"


def _load_crd(filename: str) -> dict[str, Any]:
    return load_crd(CRDS / filename)


@pytest.fixture(scope="module")
def validators() -> dict[str, jsonschema.Validator]:
    """Strict validators per kind; ``TrainJob@<release>`` for each Kubeflow Trainer release under test."""
    out = {f"TrainJob@{release}": strict_validator(path, TRAINJOB.version) for release, path in TRAINER_CRDS.items()}
    out["TrainJob"] = out["TrainJob@main"]
    out["PyTorchJob"] = strict_validator(CRDS / "kubeflow.org_pytorchjobs.yaml", PYTORCHJOB.version)
    for path, kind in ((TRAINER_CRDS["main"], TRAINJOB), (CRDS / "kubeflow.org_pytorchjobs.yaml", PYTORCHJOB)):
        crd = load_crd(path)
        assert crd["spec"]["group"] == kind.group and crd["spec"]["names"]["kind"] == kind.kind
    return out


def assert_valid(
    manifest: dict[str, Any], validators: dict[str, jsonschema.Validator], release: str | None = None
) -> None:
    validator = validators[f"{manifest['kind']}@{release}" if release else manifest["kind"]]
    errors = sorted(validator.iter_errors(manifest), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)
    # The TrainJob CRD's root CEL rules (x-kubernetes-validations, not expressible in JSON Schema).
    name = manifest["metadata"]["name"]
    assert RFC1035.match(name) and len(name) <= 63, name


CONFIGS = {
    "default": {},
    "cpu-nodes-no-placement": {
        "gpus_per_node": 0,
        "node_selector": {},
        "tolerations": [],
        "shm_size": None,
        "service_account": None,
        "s3_credentials": None,
    },
    "big": {
        "num_nodes": 16,
        "gpus_per_node": 8,
        "cpu_per_node": "96",
        "memory_per_node": "1600Gi",
        "active_deadline_s": 86400,
        "env": {"AWS_ENDPOINT_URL": "http://minio:9000", "NCCL_IB_HCA": "mlx5"},
        "tolerations": [
            {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoExecute"},
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": None},
        ],
    },
}


@pytest.mark.parametrize("release", POD_OVERRIDES_OF)
@pytest.mark.parametrize("runtime", ["torch-distributed", "deepspeed-distributed"])
@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_trainjob_validates_strictly_against_each_trainer_release(release, runtime, overrides, validators):
    """What lmforge sends to a cluster of each Trainer release passes that release's CRD with unknown fields as
    errors (fieldValidation=Strict), so nothing is pruned: the pods keep their placement and service account."""
    overrides = dict(overrides)
    if release == "v2.1.0":
        overrides.pop("active_deadline_s", None)  # no activeDeadlineSeconds in v2.1 (refused, tested below)
    cfg = LaunchConfig.model_validate({"runtime": runtime, "num_nodes": 2, "namespace": "team-a", **overrides})
    manifest = build_job(
        cfg,
        ARGS,
        image="ghcr.io/lmforge/lmforge-train:0.1.0",
        run_id="run-1",
        task="pretrain",
        pod_overrides=POD_OVERRIDES_OF[release],
    )
    assert manifest["kind"] == "TrainJob" and kind_of(manifest) is TRAINJOB
    assert_valid(manifest, validators, release)
    if cfg.node_selector:
        assert POD_OVERRIDES_OF[release] in manifest["spec"]


def test_each_trainer_release_rejects_the_other_releases_placement_field(validators):
    """The check is not vacuous: v2.1 has no runtimePatches, v2.3 no podTemplateOverrides."""
    for release, other in (("v2.1.0", "runtimePatches"), ("v2.3.0", "podTemplateOverrides")):
        manifest = build_job(LaunchConfig(num_nodes=2), ARGS, image="img", run_id="r", task="t", pod_overrides=other)
        messages = " ".join(e.message for e in validators[f"TrainJob@{release}"].iter_errors(manifest))
        assert other in messages, (release, messages)


def test_active_deadline_is_refused_for_trainer_v2_1():
    cfg = LaunchConfig(num_nodes=2, active_deadline_s=3600)
    with pytest.raises(ValueError, match="active_deadline_s"):
        build_job(cfg, ARGS, image="img", run_id="r", task="t", pod_overrides="podTemplateOverrides")


def test_explicit_pod_overrides_setting_wins_over_the_detected_one():
    cfg = LaunchConfig(num_nodes=2, trainjob_pod_overrides="podTemplateOverrides")
    manifest = build_job(cfg, ARGS, image="img", run_id="r", task="t", pod_overrides="runtimePatches")
    assert "podTemplateOverrides" in manifest["spec"] and "runtimePatches" not in manifest["spec"]


def test_job_namespace_defaults_to_the_steps_own_namespace(tmp_path, monkeypatch):
    import lmforge.launch.manifests as manifests_module

    sa_namespace = tmp_path / "namespace"
    sa_namespace.write_text("kubeflow-user-alice\n")
    monkeypatch.setattr(manifests_module, "SERVICE_ACCOUNT_NAMESPACE", sa_namespace)
    manifest = build_job(LaunchConfig(num_nodes=2), ARGS, image="img", run_id="r", task="t")
    assert manifest["metadata"]["namespace"] == "kubeflow-user-alice"
    pinned = build_job(LaunchConfig(num_nodes=2, namespace="team-b"), ARGS, image="img", run_id="r", task="t")
    assert pinned["metadata"]["namespace"] == "team-b"


@pytest.mark.parametrize("num_nodes", [1, 2, 8])
@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_pytorchjob_validates_against_crd(num_nodes, overrides, validators):
    cfg = LaunchConfig.model_validate({"backend": "pytorchjob", **overrides, "num_nodes": num_nodes})
    manifest = build_job(cfg, ARGS, image="ghcr.io/lmforge/lmforge-train:0.1.0", run_id="run-1", task="distill")
    assert manifest["kind"] == "PyTorchJob" and kind_of(manifest) is PYTORCHJOB
    assert_valid(manifest, validators)
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1
    assert replicas.get("Worker", {}).get("replicas", 0) == num_nodes - 1


def test_strict_validation_rejects_fields_the_crd_does_not_have(validators):
    """The check is not vacuous: an older Trainer field and a typo are both refused."""
    manifest = build_job(LaunchConfig(num_nodes=2), ARGS, image="img", run_id="r", task="pretrain")
    manifest["spec"]["podTemplateOverrides"] = []
    manifest["spec"]["trainer"]["numNode"] = 2
    manifest["spec"]["trainer"]["numProcPerNode"] = "auto"  # integer in this CRD version
    messages = " ".join(e.message for e in validators["TrainJob"].iter_errors(manifest))
    assert "podTemplateOverrides" in messages and "numNode" in messages and "'auto' is not of type" in messages


@pytest.mark.parametrize(
    ("runtime_file", "framework"),
    [
        (CRDS / "torch_distributed.yaml", "torch-distributed"),
        (CRDS / "deepspeed_distributed.yaml", "deepspeed-distributed"),
        *((LMFORGE_RUNTIMES / f"{runtime}.yaml", runtime) for runtime in LMFORGE_TRAINER_RUNTIMES),
    ],
    ids=lambda v: str(v.relative_to(CRDS.parents[2])) if isinstance(v, Path) else v,
)
def test_trainjob_patches_name_jobs_and_containers_the_runtime_has(runtime_file, framework):
    """For Kubeflow's stock runtimes (``runtime_name`` set to theirs) and lmforge's (the default) alike."""
    runtime = load_crd(runtime_file)
    name = runtime["metadata"]["name"]
    cfg = LaunchConfig(runtime=framework, runtime_name=None if name.startswith("lmforge-") else name, num_nodes=2)
    manifest = build_job(cfg, ARGS, image="img", run_id="r", task="pretrain")
    assert manifest["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
        "name": runtime["metadata"]["name"],
    }
    stock = {
        job["name"]: {c["name"] for c in job["template"]["spec"]["template"]["spec"]["containers"]}
        for job in runtime["spec"]["template"]["spec"]["replicatedJobs"]
    }
    (patch,) = manifest["spec"]["runtimePatches"]
    patched = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert {job["name"] for job in patched} == set(stock)  # every node pod lands on the GPU pool, launcher too
    for job in patched:
        pod = job["template"]["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"lmforge.io/pool": "gpu"}
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert pod["serviceAccountName"] == "lmforge-worker"
        assert {c["name"] for c in pod["containers"]} <= stock[job["name"]]  # "Runtime must have this container"
        assert TRAINJOB.container in stock[job["name"]]


def test_trainjob_command_and_resources_follow_the_runtime():
    cfg = LaunchConfig(num_nodes=4, gpus_per_node=8, env={"AWS_ENDPOINT_URL": "http://minio:9000"})
    torch_job = build_job(cfg, ARGS, image="img", run_id="r", task="pretrain")
    trainer = torch_job["spec"]["trainer"]
    assert trainer["command"] == ["torchrun", "-m", "lmforge", *ARGS]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (4, 8)
    assert trainer["resourcesPerNode"] == {"requests": {"nvidia.com/gpu": "8"}, "limits": {"nvidia.com/gpu": "8"}}
    env = {e["name"]: e for e in trainer["env"]}
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"]["value"] == "1"  # a collective timeout ends the pod
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio:9000"

    ds_cfg = cfg.model_copy(update={"runtime": "deepspeed-distributed"})
    command = build_job(ds_cfg, ARGS, image="img", run_id="r", task="pretrain")["spec"]["trainer"]["command"]
    assert command[0] == "mpirun" and command[-len(ARGS) - 3 :] == ["python", "-m", "lmforge", *ARGS]
    forwarded = {command[i + 1] for i, part in enumerate(command) if part == "-x"}
    assert forwarded == set(env)  # ranks started over ssh get the launcher's env, credentials included


def test_pytorchjob_pod_template_carries_placement_env_and_shm():
    cfg = LaunchConfig(backend="pytorchjob", num_nodes=3, gpus_per_node=4, memory_per_node="300Gi")
    manifest = build_job(cfg, ARGS, image="img:1", run_id="r", task="distill")
    assert manifest["spec"]["nprocPerNode"] == "4"
    assert manifest["spec"]["runPolicy"] == {"cleanPodPolicy": "Running", "backoffLimit": 3}
    for replica in manifest["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch" and container["image"] == "img:1"
        assert container["command"] == job_command(manifest) == ["torchrun", "-m", "lmforge", *ARGS]
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "4", "memory": "300Gi"}
        assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
        assert pod["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
        assert pod["priorityClassName"] == "lmforge-training"
        assert pod["nodeSelector"] == {"lmforge.io/pool": "gpu"}


@pytest.mark.parametrize("backend", ["trainjob", "pytorchjob"])
@pytest.mark.parametrize(
    ("overrides", "mesh"), [({}, (1, 32, 1)), ({"train.distributed.mesh.tensor_parallel": 8}, (1, 4, 8))]
)
def test_the_multi_node_job_carries_the_presets_mesh_and_the_runs_overrides(backend, overrides, mesh, monkeypatch):
    """``llama-8b`` on 4 nodes × 8 GPUs: the command every pod runs resolves, through the real ``lmforge stage``
    command line, to an fsdp2 config whose mesh multiplies to the ranks the job starts."""
    from typer.testing import CliRunner

    from lmforge.cli import app
    from lmforge.launch import stage_runner
    from lmforge.results import StageResult

    seen: list[Any] = []

    def capture(stage: str, cfg: Any, paths: dict, **_: Any) -> Any:
        seen.append(cfg)
        return StageResult()

    monkeypatch.setattr(stage_runner, "run_stage_uris", capture)
    args = stage_args("pretrain", {"shards": "s3://b/s", "model": "s3://b/m"}, preset="llama-8b", overrides=overrides)
    manifest = build_job(LaunchConfig(backend=backend, num_nodes=4, gpus_per_node=8), args, image="i", run_id="r",
                         task="pretrain")  # fmt: skip
    command = job_command(manifest)
    assert command[:3] == ["torchrun", "-m", "lmforge"]
    outcome = CliRunner().invoke(app, command[3:])
    assert outcome.exit_code == 0, outcome.output
    (cfg,) = seen
    distributed = cfg.train.distributed
    assert distributed.backend == "fsdp2"
    pp = distributed.mesh.pipeline_parallel
    nodes, procs = nodes_and_procs(manifest)
    assert (pp, *distributed.mesh.degrees(nodes * procs)) == mesh


@pytest.mark.parametrize("backend", ["trainjob", "pytorchjob"])
def test_secret_values_never_appear_in_manifests_only_secret_key_refs(backend, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA-SHOULD-NOT-LEAK")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "super-secret-value-should-not-leak")
    cfg = LaunchConfig(backend=backend, num_nodes=2, s3_credentials=SecretEnvConfig(name="team-s3"))
    manifest = build_job(cfg, ARGS, image="img", run_id="r", task="pretrain")
    text = json.dumps(manifest)
    assert "SHOULD-NOT-LEAK" not in text and "should-not-leak" not in text
    if backend == "trainjob":
        env = manifest["spec"]["trainer"]["env"]
    else:
        env = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]
    secret_env = {e["name"]: e for e in env if "valueFrom" in e}
    assert set(secret_env) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    for name, item in secret_env.items():
        assert "value" not in item
        assert item["valueFrom"] == {"secretKeyRef": {"name": "team-s3", "key": name, "optional": False}}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("WANDB_API_KEY", "wandb-key-1234"),
        ("OPENAI_API_KEY", "sk-123456"),
        ("DB_PASSWD", "hunter22"),
        ("SENTRY_DSN", "https://abc@o1.ingest.sentry.io/1"),
        ("openaiApiKey", "sk-123456"),
        ("GH_AUTH", "ghp_123456"),
        ("AZURE_STORAGE_CONNECTION_STRING", "AccountKey=abc"),
        ("SSH_PRIVATE", "-----BEGIN"),
        ("DATABASE_URL", "postgres://app:hunter22@db:5432/app"),
    ],
)
def test_env_that_may_hold_a_credential_is_refused_saying_how_to_pass_it_by_secret_reference(name, value):
    with pytest.raises(ConfigError) as caught:
        validate_config(LaunchConfig, {"env": {name: value}}, prefix="launch")
    message = str(caught.value)
    assert name in message and "secret_env" in message and "kubectl create secret" in message
    assert value not in message


@pytest.mark.parametrize("name", ["AWS_ENDPOINT_URL", "NCCL_IB_HCA", "WANDB_PROJECT", "TOKENIZERS_PARALLELISM"])
def test_plain_settings_stay_allowed_in_env(name):
    assert validate_config(LaunchConfig, {"env": {name: "http://minio:9000"}}).env == {name: "http://minio:9000"}


@pytest.mark.parametrize(("backend", "release"), [*(("trainjob", r) for r in POD_OVERRIDES_OF), ("pytorchjob", None)])
def test_secret_env_reaches_the_pods_as_secret_key_refs_and_validates(backend, release, validators):
    cfg = validate_config(
        LaunchConfig,
        {
            "backend": backend,
            "num_nodes": 2,
            "secret_env": {"WANDB_API_KEY": {"secret": "wandb", "key": "api-key"}},
            "env": {"WANDB_PROJECT": "lmforge"},
        },
    )
    overrides = POD_OVERRIDES_OF.get(release, "runtimePatches")
    manifest = build_job(cfg, ARGS, image="img", run_id="r", task="pretrain", pod_overrides=overrides)
    assert_valid(manifest, validators, release)
    if backend == "trainjob":
        env = manifest["spec"]["trainer"]["env"]
    else:
        env = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]
    (wandb,) = [e for e in env if e["name"] == "WANDB_API_KEY"]
    assert wandb == {
        "name": "WANDB_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key", "optional": False}},
    }


def test_secret_env_names_are_env_names_set_in_one_place():
    ref = {"secret": "wandb", "key": "api-key"}
    with pytest.raises(ConfigError, match="secret_env: 'WANDB_API_KEY' is also set in s3_credentials.keys"):
        validate_config(
            LaunchConfig, {"secret_env": {"WANDB_API_KEY": ref}, "s3_credentials": {"keys": ["WANDB_API_KEY"]}}
        )
    with pytest.raises(ConfigError, match="not a valid env var name"):
        validate_config(LaunchConfig, {"secret_env": {"1X": ref}})
    with pytest.raises(ConfigError, match="secret_env"):
        validate_config(LaunchConfig, {"secret_env": {"X": {"secret": "Not A Name", "key": "k"}}})


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"env": {"AWS_SECRET_ACCESS_KEY": "x"}}, "AWS_SECRET_ACCESS_KEY"),
        ({"env": {"HF_TOKEN": "x"}}, "HF_TOKEN"),
        ({"env": {"DB_PASSWORD": "x"}}, "DB_PASSWORD"),
        ({"env": {"1BAD": "x"}}, "1BAD"),
        ({"backend": "pytorchjob", "runtime": "deepspeed-distributed"}, "runtime"),
        ({"backend": "pytorchjob", "runtime_name": "torch-distributed"}, "runtime_name"),
        ({"runtime_name": "deepspeed-distributed"}, "runtime_name"),
        ({"runtime_name": "Not_A_Name"}, "runtime_name"),
        ({"num_nodes": 0}, "num_nodes"),
        ({"gpus_per_node": True}, "gpus_per_node"),
        ({"namespace": "Not_A_Label"}, "namespace"),
        ({"memory_per_node": "lots"}, "memory_per_node"),
        ({"tolerations": [{"key": "a", "operator": "Exists", "value": "b"}]}, "tolerations"),
        ({"s3_credentials": {"name": "s3", "keys": ["not an env name"]}}, "s3_credentials"),
        ({"podTemplateOverrides": {}}, "podTemplateOverrides"),
    ],
)
def test_launch_config_rejects_bad_values_naming_the_field(bad, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        validate_config(LaunchConfig, bad, prefix="launch")


@settings(max_examples=200, deadline=None)
@given(run_id=st.text(min_size=1, max_size=200), task=st.text(min_size=1, max_size=200))
def test_job_name_is_a_short_deterministic_rfc1035_label(run_id, task):
    name = job_name(run_id, task)
    assert RFC1035.match(name) and len(name) <= MAX_JOB_NAME
    assert job_name(run_id, task) == name
    assert job_name(run_id + "x", task) != name


def test_job_name_reads_as_the_task_and_separates_runs():
    run = "3f1c0a9e-8d5b-4b7e-9a51-0c2f8e6d4b11"
    assert job_name(run, "pretrain").startswith("lmf-pretrain-")
    assert job_name(run, "pretrain") != job_name(run, "distill")
    assert job_name(run, "pretrain") != job_name(run.replace("3", "4"), "pretrain")
    long = job_name(run, "A very long task name " * 10, max_length=63)
    assert len(long) <= 63 and RFC1035.match(long)
    with pytest.raises(ValueError, match="prefix"):
        job_name(run, "pretrain", prefix="9x")


def test_manifests_are_deterministic_and_record_the_run():
    cfg = LaunchConfig(num_nodes=2)
    first = build_job(cfg, ARGS, image="img", run_id="run-7", task="pretrain")
    assert first == build_job(cfg, ARGS, image="img", run_id="run-7", task="pretrain")
    meta = first["metadata"]
    assert meta["annotations"]["lmforge.io/run-id"] == "run-7" and meta["labels"]["lmforge.io/task"] == "pretrain"
    other = build_job(cfg, [*ARGS, "--set", "train.lr=0.001"], image="img", run_id="run-7", task="pretrain")
    assert other["metadata"]["name"] == meta["name"]  # same step, same job ...
    assert other["metadata"]["annotations"]["lmforge.io/spec-hash"] != meta["annotations"]["lmforge.io/spec-hash"]


def test_single_pod_command_runs_torchrun_over_the_pods_gpus():
    assert single_pod_command(8, ["stage", "pretrain"]) == [
        "torchrun",
        "--standalone",
        "--nproc_per_node=8",
        "-m",
        "lmforge",
        "stage",
        "pretrain",
    ]
    with pytest.raises(ValueError, match="gpus_per_node"):
        single_pod_command(0, [])


def test_stage_args_are_the_cli_stage_arguments():
    args = stage_args("pretrain", {"shards": "s3://b/s", "model": "s3://b/m"}, preset="p", overrides={"train.lr": 1e-3})
    assert args == [
        "stage",
        "pretrain",
        "--preset",
        "p",
        "--io",
        "model=s3://b/m",
        "--io",
        "shards=s3://b/s",
        "--set",
        "train.lr=0.001",
    ]


def test_builders_take_explicit_names():
    cfg = LaunchConfig(num_nodes=2, namespace="lmforge")
    assert build_trainjob("my-job", cfg, ARGS, image="i", run_id="r", task="t")["metadata"]["name"] == "my-job"
    pj = build_pytorchjob(
        "my-job", cfg.model_copy(update={"backend": "pytorchjob"}), ARGS, image="i", run_id="r", task="t"
    )
    assert pj["metadata"]["namespace"] == "lmforge"


def test_tolerations_config_maps_to_kubernetes_fields():
    cfg = LaunchConfig(tolerations=[TolerationConfig(key="k", operator="Equal", value="v", effect=None)])
    pod = build_job(cfg.model_copy(update={"backend": "pytorchjob"}), ARGS, image="i", run_id="r", task="t")
    spec = pod["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert spec["tolerations"] == [{"key": "k", "operator": "Equal", "value": "v"}]


RUNTIME_OF = {  # Trainer release -> its stock torch-distributed runtime (deepspeed: main only)
    "v2.1.0": "trainer-v2.1.0/torch_distributed.yaml",
    "v2.3.0": "trainer-v2.3.0/torch_distributed.yaml",
    "main": "torch_distributed.yaml",
}


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize(
    ("release", "runtime_file"),
    [
        *RUNTIME_OF.items(),
        ("v2.1.0", "trainer-v2.1.0/deepspeed_distributed.yaml"),
        ("v2.3.0", "deepspeed_distributed.yaml"),
    ],
)
def test_trainjob_pods_meet_pod_security_restricted_where_the_trainer_can_say_so(
    release, runtime_file, overrides, validators
):
    """The pods Trainer makes of the stock runtime and lmforge's patches pass the ``restricted`` checks
    (tests/support/pod_security.py) and the TrainJob still validates strictly. Trainer v2.1's podTemplateOverrides
    has no securityContext field: there the pods are as restricted as the runtime makes them, and the stock ones
    set nothing restricted needs, so exactly the four checks that need a securityContext fail. That is why lmforge
    ships its own runtimes (next test)."""
    runtime = _load_crd(runtime_file)
    fields = {k: v for k, v in overrides.items() if k != "active_deadline_s" or release != "v2.1.0"}
    name = runtime["metadata"]["name"]
    cfg = LaunchConfig.model_validate({"runtime": name, "runtime_name": name, "num_nodes": 2, **fields})
    manifest = build_job(cfg, ARGS, image="img", run_id="r", task="pretrain", pod_overrides=POD_OVERRIDES_OF[release])
    assert_valid(manifest, validators, release)
    for job, pod in trainjob_pods(manifest, runtime).items():
        violations = restricted_violations(pod)
        if release == "v2.1.0":
            failed = {v.split(":")[0] for v in violations}
            assert failed == {
                "allowPrivilegeEscalation",
                "capabilities_restricted",
                "runAsNonRoot",
                "seccompProfile_restricted",
            }
        else:
            assert violations == [], (job, violations)
        assert pod.get("serviceAccountName") == fields.get("service_account", "lmforge-worker")


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("runtime", LMFORGE_TRAINER_RUNTIMES)
@pytest.mark.parametrize("release", ["v2.1.0", "v2.3.0"])
def test_trainjob_pods_meet_pod_security_restricted_on_every_trainer_release_with_lmforge_runtimes(
    release, runtime, overrides, validators
):
    """By default a TrainJob refers to lmforge's runtime (manifests/trainer-runtimes), whose pod template carries
    the securityContext that Trainer v2.1's podTemplateOverrides cannot: the pods Trainer makes of it and lmforge's
    placement pass every ``restricted`` check on v2.1 as on v2.3, mount no API token, and the TrainJob validates
    strictly."""
    fields = {k: v for k, v in overrides.items() if k != "active_deadline_s" or release != "v2.1.0"}
    cfg = LaunchConfig.model_validate({"runtime": runtime, "num_nodes": 2, **fields})
    manifest = build_job(cfg, ARGS, image="img", run_id="r", task="pretrain", pod_overrides=POD_OVERRIDES_OF[release])
    assert_valid(manifest, validators, release)
    hardened = load_crd(LMFORGE_RUNTIMES / f"{runtime}.yaml")
    assert manifest["spec"]["runtimeRef"]["name"] == hardened["metadata"]["name"] == LMFORGE_TRAINER_RUNTIMES[runtime]
    pods = trainjob_pods(manifest, hardened)
    assert set(pods) == ({"node", "launcher"} if runtime == "deepspeed-distributed" else {"node"})
    for job, pod in pods.items():
        assert restricted_violations(pod) == [], (job, restricted_violations(pod))
        assert pod["automountServiceAccountToken"] is False
        assert pod.get("serviceAccountName") == fields.get("service_account", "lmforge-worker")


def _without_security(obj: Any) -> Any:
    if isinstance(obj, dict):
        drop = {"securityContext", "automountServiceAccountToken"}
        return {k: _without_security(v) for k, v in obj.items() if k not in drop}
    return [_without_security(v) for v in obj] if isinstance(obj, list) else obj


@pytest.mark.parametrize("runtime", LMFORGE_TRAINER_RUNTIMES)
def test_lmforge_runtimes_are_the_stock_ones_with_restricted_pods(runtime):
    """lmforge's runtime keeps all of Kubeflow's stock one (ML policy, MPI settings, network, success policy,
    replicated jobs in order with their dependencies, images, commands, probes, the framework label the Kubeflow SDK
    reads) and adds only security settings; each of its pods is ``restricted`` on its own."""
    hardened = load_crd(LMFORGE_RUNTIMES / f"{runtime}.yaml")
    stock = _load_crd(f"{runtime.replace('-', '_')}.yaml")  # Trainer main @ 8c0f5059, the same as v2.3.0
    assert hardened["kind"] == stock["kind"] and hardened["metadata"]["labels"] == stock["metadata"]["labels"]
    assert _without_security(hardened["spec"]) == _without_security(stock["spec"])
    for job in hardened["spec"]["template"]["spec"]["replicatedJobs"]:
        pod = job["template"]["spec"]["template"]["spec"]
        assert restricted_violations(pod) == [], job["name"]
        assert pod["automountServiceAccountToken"] is False


def test_runtime_name_chooses_the_runtime_and_must_start_training_as_runtime_says():
    assert LaunchConfig().trainjob_runtime == "lmforge-torch-distributed"
    assert LaunchConfig(runtime="deepspeed-distributed").trainjob_runtime == "lmforge-deepspeed-distributed"
    assert LaunchConfig(runtime_name="torch-distributed").trainjob_runtime == "torch-distributed"
    assert LaunchConfig(runtime_name="team-torch-restricted").trainjob_runtime == "team-torch-restricted"
    with pytest.raises(
        ConfigError,
        match="runtime_name 'lmforge-deepspeed-distributed' starts training as "
        "deepspeed-distributed does, but runtime is 'torch-distributed'",
    ):
        validate_config(LaunchConfig, {"runtime_name": "lmforge-deepspeed-distributed"}, prefix="launch")


@pytest.mark.parametrize("num_nodes", [1, 3])
@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_pytorchjob_pods_meet_pod_security_restricted_and_mount_no_api_token(num_nodes, overrides, validators):
    cfg = LaunchConfig.model_validate({"backend": "pytorchjob", **overrides, "num_nodes": num_nodes})
    manifest = build_job(cfg, ARGS, image="img", run_id="r", task="distill")
    assert_valid(manifest, validators)
    for kind, pod in pytorchjob_pods(manifest).items():
        assert restricted_violations(pod) == [], kind
        assert pod["automountServiceAccountToken"] is False


def test_the_restricted_checker_refuses_what_the_profile_forbids():
    """The stand-in is not vacuous: each kind of breach is caught, by the check upstream names."""
    good = {
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [
            {"name": "c", "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}
        ],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    assert restricted_violations(good) == []
    breaches = {
        "hostNamespaces": {"hostNetwork": True},
        "restrictedVolumes": {"volumes": [{"name": "h", "hostPath": {"path": "/"}}]},
        "runAsNonRoot": {"securityContext": {"seccompProfile": {"type": "RuntimeDefault"}}},
        "seccompProfile_restricted": {
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "Unconfined"}}
        },
        "sysctls": {
            "securityContext": {**good["securityContext"], "sysctls": [{"name": "kernel.msgmax", "value": "1"}]}
        },
    }
    for check, change in breaches.items():
        assert [v.split(":")[0] for v in restricted_violations({**good, **change})] == [check]
    container = good["containers"][0]
    for check, sc in {
        "privileged": {"privileged": True},
        "capabilities_restricted": {"capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]}},
        "allowPrivilegeEscalation": {"allowPrivilegeEscalation": True},
        "runAsUser": {"runAsUser": 0},
    }.items():
        pod = {**good, "initContainers": [{"name": "i", "securityContext": {**container["securityContext"], **sc}}]}
        assert check in [v.split(":")[0] for v in restricted_violations(pod)], check
    ports = {**good, "containers": [{**container, "ports": [{"containerPort": 80, "hostPort": 80}]}]}
    assert [v.split(":")[0] for v in restricted_violations(ports)] == ["hostPorts"]
