"""Pure builders for the Kubernetes objects ``lmforge.launch`` submits: names, commands and job manifests.

Nothing here talks to a cluster. The manifests follow the CRDs as published by Kubeflow (copies under
``tests/data/crds/``, where the tests validate every builder's output against them):

- ``TrainJob`` (Kubeflow Trainer v2, ``trainer.kubeflow.org/v1alpha1``): the ``ClusterTrainingRuntime`` it refers
  to (by default lmforge's, ``manifests/trainer-runtimes``) supplies the pod template; lmforge sets
  ``spec.trainer`` (image, command, nodes, GPUs, env) and places the pods (node selector, tolerations, service
  account, /dev/shm) with the field the cluster's Trainer has:
  ``spec.runtimePatches`` (v2.2 and later) or ``spec.podTemplateOverrides`` (v2.1, what Kubeflow 1.11 ships;
  v2.1 has no ``activeDeadlineSeconds`` either). The CRDs of both are under ``tests/data/crds/``.
- ``PyTorchJob`` (Training Operator v1, ``kubeflow.org/v1``): a full pod template per replica type
  (``Master`` + ``Worker``), ``nprocPerNode`` and ``runPolicy``.

Pods meet Pod Security ``restricted`` (:mod:`lmforge.pod_security`) wherever the job kind lets lmforge say so: the
PyTorchJob pod template and a TrainJob's ``runtimePatches``; Trainer v2.1's ``podTemplateOverrides`` has no
``securityContext``, so there the runtime's applies (lmforge's runtimes set it). Credentials come only as
``secretKeyRef``.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lmforge.cluster import GPU_RESOURCE
from lmforge.config import LaunchConfig
from lmforge.pod_security import container_security_context, pod_security_context

PATCH_MANAGER = "lmforge.io/launch"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_TASK = "lmforge.io/task"
LABEL_RUN_HASH = "lmforge.io/run-hash"
ANNOTATION_RUN_ID = "lmforge.io/run-id"
ANNOTATION_TASK = "lmforge.io/task"
ANNOTATION_SPEC_HASH = "lmforge.io/spec-hash"

# Env that makes the collective timeout (the stage's ``distributed.timeout_minutes``, passed to
# init_process_group) effective: on a timed-out or failed collective, PyTorch's NCCL watchdog aborts the
# communicator and ends the process, so the pod fails and the job reports it, instead of hanging on.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_DEBUG": "WARN"}
# Pods and services the operators derive from the job name add suffixes ("-master-0", "-node-0-0-xxxxx")
# that must still fit a 63-character DNS label, so job names stay well below 63.
MAX_JOB_NAME = 40
_HASH_LEN = 10
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")

PodOverrides = Literal["runtimePatches", "podTemplateOverrides"]


@dataclass(frozen=True)
class JobKind:
    """Where a job kind lives in the API and how its operator labels pods and reports the outcome."""

    kind: str
    group: str
    version: str
    plural: str
    pod_label: str  # label the operator puts on the job's pods, value = job name
    container: str  # name of the training container in those pods
    succeeded: str  # condition type meaning success
    failed: str = "Failed"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


TRAINJOB = JobKind(
    kind="TrainJob",
    group="trainer.kubeflow.org",
    version="v1alpha1",
    plural="trainjobs",
    pod_label="jobset.sigs.k8s.io/jobset-name",  # Trainer runs a JobSet named after the TrainJob
    container="node",  # the container name in the torch-/deepspeed-distributed runtimes, stock and lmforge's
    succeeded="Complete",
)
PYTORCHJOB = JobKind(
    kind="PyTorchJob",
    group="kubeflow.org",
    version="v1",
    plural="pytorchjobs",
    pod_label="training.kubeflow.org/job-name",
    container="pytorch",  # the Training Operator requires this container name
    succeeded="Succeeded",
)
JOB_KINDS = {"trainjob": TRAINJOB, "pytorchjob": PYTORCHJOB}


def kind_of(manifest: Mapping[str, Any]) -> JobKind:
    """The :class:`JobKind` of a manifest built here (by apiVersion and kind)."""
    for job_kind in JOB_KINDS.values():
        if manifest.get("apiVersion") == job_kind.api_version and manifest.get("kind") == job_kind.kind:
            return job_kind
    raise ValueError(f"not a TrainJob or PyTorchJob manifest: {manifest.get('apiVersion')}/{manifest.get('kind')}")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def job_name(run_id: str, task: str, *, prefix: str = "lmf", max_length: int = MAX_JOB_NAME) -> str:
    """Deterministic job name for (pipeline run id, task name): same inputs, same name, so a retry adopts.

    The name is an RFC 1035 label (TrainJob's CEL rule: starts with a letter, ``[-a-z0-9]``, ends
    alphanumeric), ``prefix-<task slug>-<10 hex of sha256(run_id, task)>``, at most ``max_length`` chars.
    The slug is only for people reading ``kubectl get``; uniqueness comes from the hash.
    """
    if not run_id or not task:
        raise ValueError("job_name needs a non-empty run id and task name")
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", prefix):
        raise ValueError(f"prefix {prefix!r} must be a lowercase RFC 1035 label")
    if not 16 <= max_length <= 63:
        raise ValueError(f"max_length must be within 16..63, got {max_length}")
    digest = hashlib.sha256(f"{run_id}\0{task}".encode()).hexdigest()[:_HASH_LEN]
    room = max_length - len(prefix) - len(digest) - 2
    slug = _slug(task)[: max(room, 0)].strip("-")
    return "-".join(p for p in (prefix, slug, digest) if p)


def stage_args(
    stage: str, io: Mapping[str, str], *, preset: str, overrides: Mapping[str, Any] | None = None
) -> list[str]:
    """Arguments of ``lmforge stage <stage> ...`` (after the program name), deterministic in order."""
    args = ["stage", stage, "--preset", preset]
    for key in sorted(io):
        args += ["--io", f"{key}={io[key]}"]
    for key in sorted(overrides or {}):
        args += ["--set", f"{key}={json.dumps(overrides[key])}"]
    return args


def single_pod_command(
    gpus_per_node: int,
    args: Sequence[str],
    *,
    module: str = "lmforge",
    launcher: Sequence[str] = ("torchrun",),
) -> list[str]:
    """``torchrun --standalone --nproc_per_node=<gpus_per_node> -m lmforge <args>``: one process per GPU of one pod.

    ``--standalone`` runs the rendezvous inside the pod (a free port on localhost), so nothing else
    is needed; DDP and DeepSpeed both read the env torchrun sets. ``launcher`` replaces the ``torchrun``
    program, e.g. ``(sys.executable, "-m", "torch.distributed.run")`` where no script is on ``PATH``.
    """
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    return [*launcher, "--standalone", f"--nproc_per_node={gpus_per_node}", "-m", module, *args]


def _procs_per_node(cfg: LaunchConfig) -> int:
    return max(cfg.gpus_per_node, 1)


def world_size(cfg: LaunchConfig) -> int:
    """Training processes the launch starts: one per GPU (one per pod without GPUs) on every node."""
    return cfg.num_nodes * _procs_per_node(cfg)


def _env(cfg: LaunchConfig) -> list[dict[str, Any]]:
    """Plain settings first, then credentials as ``secretKeyRef`` (never values)."""
    plain = {
        **NCCL_ENV,
        "PYTHONUNBUFFERED": "1",  # logs reach `kubectl logs` (and the step's log stream) as they are written
        **cfg.env,
    }
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in plain.items()]
    if cfg.s3_credentials is not None:
        ref = cfg.s3_credentials
        env += [
            {"name": key, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": key, "optional": ref.optional}}}
            for key in ref.keys
        ]
    env += [
        {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.secret, "key": ref.key, "optional": ref.optional}}}
        for name, ref in cfg.secret_env.items()
    ]
    return env


def _resources(cfg: LaunchConfig) -> dict[str, dict[str, str]]:
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if cfg.gpus_per_node:
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(cfg.gpus_per_node)
    if cfg.cpu_per_node:
        requests["cpu"] = cfg.cpu_per_node
    if cfg.memory_per_node:
        requests["memory"] = limits["memory"] = cfg.memory_per_node
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def _tolerations(cfg: LaunchConfig) -> list[dict[str, str]]:
    return [
        {k: v for k, v in (("key", t.key), ("operator", t.operator), ("value", t.value), ("effect", t.effect)) if v}
        for t in cfg.tolerations
    ]


def _shm(cfg: LaunchConfig) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    if not cfg.shm_size:
        return [], []
    volume = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": cfg.shm_size}}
    return [volume], [{"name": "dshm", "mountPath": "/dev/shm"}]


def current_namespace() -> str:
    """The namespace this process runs in: its pod's service account namespace, else the kubeconfig context's.

    Falls back to ``default``, as ``kubectl`` does.
    """
    if SERVICE_ACCOUNT_NAMESPACE.is_file():
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    from kubernetes import config as k8s_config

    try:
        _, context = k8s_config.list_kube_config_contexts()
    except (k8s_config.ConfigException, OSError):
        return "default"
    return (context or {}).get("context", {}).get("namespace") or "default"


def job_namespace(cfg: LaunchConfig) -> str:
    """Where the job goes: ``cfg.namespace`` if set, else :func:`current_namespace`."""
    return cfg.namespace or current_namespace()


def _metadata(name: str, cfg: LaunchConfig, run_id: str, task: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    spec_hash = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return {
        "name": name,
        "namespace": job_namespace(cfg),
        "labels": {
            LABEL_PART_OF: "lmforge",
            LABEL_TASK: _slug(task)[:63].strip("-") or "task",
            LABEL_RUN_HASH: hashlib.sha256(run_id.encode()).hexdigest()[:16],
        },
        # Full values (labels are limited to 63 chars) so an operator can find the run from the job.
        "annotations": {ANNOTATION_RUN_ID: run_id, ANNOTATION_TASK: task, ANNOTATION_SPEC_HASH: spec_hash},
    }


def _mpirun(args: Sequence[str], env: Sequence[Mapping[str, Any]], module: str) -> list[str]:
    # mpirun starts the ranks over ssh on the node pods, which do not inherit the launcher's env: forward it.
    forward = [part for item in env for part in ("-x", item["name"])]
    return ["mpirun", "--bind-to", "none", *forward, "python", "-m", module, *args]


def _placement(cfg: LaunchConfig) -> dict[str, Any]:
    """The pod spec fields that place a training pod: node selector, tolerations, service account."""
    placement: dict[str, Any] = {}
    if cfg.node_selector:
        placement["nodeSelector"] = dict(cfg.node_selector)
    if cfg.tolerations:
        placement["tolerations"] = _tolerations(cfg)
    if cfg.service_account:
        placement["serviceAccountName"] = cfg.service_account
    return placement


def _trainer_command(
    cfg: LaunchConfig, args: Sequence[str], env: Sequence[Mapping[str, Any]], module: str
) -> list[str]:
    """The trainer's command: ``torchrun -m <module> ...``, or ``mpirun ...`` for the DeepSpeed runtime."""
    if cfg.runtime == "deepspeed-distributed":
        return _mpirun(args, env, module)
    return ["torchrun", "-m", module, *args]


def _patched_jobs(cfg: LaunchConfig) -> list[str]:
    """The runtime's replicated jobs whose pods lmforge places."""
    if cfg.runtime == "deepspeed-distributed":
        return ["node", "launcher"]  # the launcher also trains (runLauncherAsNode) and needs the GPU pool
    return ["node"]


def _trainer(cfg: LaunchConfig, args: Sequence[str], *, image: str, module: str) -> dict[str, Any]:
    """``spec.trainer`` of a TrainJob: image, command, nodes, processes per node, env and resources."""
    env = _env(cfg)
    trainer: dict[str, Any] = {
        "image": image,
        "command": _trainer_command(cfg, args, env, module),
        "numNodes": cfg.num_nodes,
        "numProcPerNode": _procs_per_node(cfg),
        "env": env,
    }
    resources = _resources(cfg)
    if resources:
        trainer["resourcesPerNode"] = resources
    return trainer


def _trainjob_pod_spec(cfg: LaunchConfig, pod_overrides: PodOverrides) -> dict[str, Any]:
    """What a TrainJob adds to the runtime's pod spec: placement, /dev/shm and, where it can, the security context."""
    volumes, mounts = _shm(cfg)
    pod_spec = _placement(cfg)
    container: dict[str, Any] = {"name": TRAINJOB.container}
    if volumes:
        pod_spec["volumes"] = volumes
        container["volumeMounts"] = mounts
    if pod_overrides == "runtimePatches":  # Trainer v2.1's podTemplateOverrides has no securityContext
        pod_spec["securityContext"] = pod_security_context()
        container["securityContext"] = container_security_context()
    if len(container) > 1:
        pod_spec["containers"] = [container]
    return pod_spec


def _pod_overrides(pod_spec: Mapping[str, Any], jobs: Sequence[str], pod_overrides: PodOverrides) -> dict[str, Any]:
    """The TrainJob spec field (named ``pod_overrides``) that applies ``pod_spec`` to the pods of ``jobs``."""
    if not pod_spec:
        return {}
    if pod_overrides == "podTemplateOverrides":
        return {"podTemplateOverrides": [{"targetJobs": [{"name": job} for job in jobs], "spec": pod_spec}]}
    replicated_jobs = [{"name": job, "template": {"spec": {"template": {"spec": pod_spec}}}} for job in jobs]
    return {
        "runtimePatches": [
            {
                "manager": PATCH_MANAGER,
                "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": replicated_jobs}}},
            }
        ]
    }


def build_trainjob(
    name: str,
    cfg: LaunchConfig,
    args: Sequence[str],
    *,
    image: str,
    run_id: str,
    task: str,
    module: str = "lmforge",
    pod_overrides: PodOverrides = "runtimePatches",
) -> dict[str, Any]:
    """A ``TrainJob`` running ``python -m lmforge <args>`` on ``cfg.num_nodes`` nodes of the runtime.

    torch-distributed: ``torchrun -m lmforge ...``; Trainer sets the ``PET_*`` env torchrun reads
    (nodes, procs per node, node rank, master address). deepspeed-distributed: ``mpirun ... python -m
    lmforge ...`` from the launcher pod; Trainer provides the hostfile (``numProcPerNode`` slots per node).
    ``pod_overrides`` names the TrainJob field that places the pods: ``runtimePatches`` (Trainer >= v2.2)
    or ``podTemplateOverrides`` (Trainer v2.1).
    """
    if pod_overrides == "podTemplateOverrides" and cfg.active_deadline_s:
        raise ValueError(
            "active_deadline_s: Kubeflow Trainer v2.1 TrainJobs have no activeDeadlineSeconds; "
            "use wait_timeout_s, or Trainer >= v2.2"
        )
    pod_spec = _trainjob_pod_spec(cfg, pod_overrides)
    spec: dict[str, Any] = {
        "runtimeRef": {"apiGroup": TRAINJOB.group, "kind": cfg.runtime_kind, "name": cfg.trainjob_runtime},
        "trainer": _trainer(cfg, args, image=image, module=module),
        **_pod_overrides(pod_spec, _patched_jobs(cfg), pod_overrides),
    }
    if cfg.active_deadline_s:
        spec["activeDeadlineSeconds"] = cfg.active_deadline_s
    return {
        "apiVersion": TRAINJOB.api_version,
        "kind": TRAINJOB.kind,
        "metadata": _metadata(name, cfg, run_id, task, spec),
        "spec": spec,
    }


def build_pytorchjob(
    name: str, cfg: LaunchConfig, args: Sequence[str], *, image: str, run_id: str, task: str, module: str = "lmforge"
) -> dict[str, Any]:
    """A ``PyTorchJob``: one ``Master`` and ``num_nodes - 1`` ``Worker`` pods, each ``torchrun -m lmforge ...``.

    The operator sets the ``PET_*`` env torchrun reads (``nprocPerNode`` → ``PET_NPROC_PER_NODE``).
    Pods restart on failure up to ``backoff_limit``; ``cleanPodPolicy: Running`` stops stragglers when
    the job ends but keeps finished pods, so their logs stay readable.
    """
    volumes, mounts = _shm(cfg)
    container: dict[str, Any] = {
        "name": PYTORCHJOB.container,
        "image": image,
        "command": ["torchrun", "-m", module, *args],
        "env": _env(cfg),
        "securityContext": container_security_context(),
    }
    resources = _resources(cfg)
    if resources:
        container["resources"] = resources
    if mounts:
        container["volumeMounts"] = mounts
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "securityContext": pod_security_context(),
        "automountServiceAccountToken": False,  # training needs S3, nothing of the Kubernetes API
        **_placement(cfg),
    }
    if cfg.priority_class:
        pod_spec["priorityClassName"] = cfg.priority_class
    if volumes:
        pod_spec["volumes"] = volumes

    def replica(count: int) -> dict[str, Any]:
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": pod_spec}}

    replicas = {"Master": replica(1)}
    if cfg.num_nodes > 1:
        replicas["Worker"] = replica(cfg.num_nodes - 1)
    run_policy: dict[str, Any] = {"cleanPodPolicy": "Running", "backoffLimit": cfg.backoff_limit}
    if cfg.active_deadline_s:
        run_policy["activeDeadlineSeconds"] = cfg.active_deadline_s
    spec = {"nprocPerNode": str(_procs_per_node(cfg)), "runPolicy": run_policy, "pytorchReplicaSpecs": replicas}
    return {
        "apiVersion": PYTORCHJOB.api_version,
        "kind": PYTORCHJOB.kind,
        "metadata": _metadata(name, cfg, run_id, task, spec),
        "spec": spec,
    }


def build_job(
    cfg: LaunchConfig,
    args: Sequence[str],
    *,
    image: str,
    run_id: str,
    task: str,
    module: str = "lmforge",
    pod_overrides: PodOverrides = "runtimePatches",
) -> dict[str, Any]:
    """The job for ``cfg.backend``, named by :func:`job_name` from (run id, task).

    ``pod_overrides`` (TrainJob only) is used when ``cfg.trainjob_pod_overrides`` is ``auto``.
    """
    name = job_name(run_id, task)
    if cfg.backend == "pytorchjob":
        return build_pytorchjob(name, cfg, args, image=image, run_id=run_id, task=task, module=module)
    chosen = pod_overrides if cfg.trainjob_pod_overrides == "auto" else cfg.trainjob_pod_overrides
    return build_trainjob(name, cfg, args, image=image, run_id=run_id, task=task, module=module, pod_overrides=chosen)


def job_command(manifest: Mapping[str, Any]) -> list[str]:
    """The training command of a manifest built here (TrainJob trainer or PyTorchJob Master container)."""
    spec = manifest.get("spec", {})
    if "trainer" in spec:
        return list(spec["trainer"].get("command", []))
    pod = spec["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    return list(pod["containers"][0].get("command", []))


def describe_command(command: Sequence[str]) -> str:
    """A command as one shell-quoted line (for logs)."""
    return shlex.join(command)
