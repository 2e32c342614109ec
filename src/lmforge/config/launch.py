"""Config of multi-node training jobs on Kubernetes (Kubeflow Trainer ``TrainJob`` or ``PyTorchJob``)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from lmforge.cluster import GPU_POOL_NODE_SELECTOR, GPU_POOL_TOLERATION, GPU_RESOURCE
from lmforge.config.base import (
    DNS_LABEL,
    DNS_SUBDOMAIN,
    QUANTITY,
    URL_PASSWORD,
    StrictModel,
    credential_fragment,
)

_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
_SECRET_KEY = r"^[-._a-zA-Z0-9]+$"  # a key of a Secret's data (Kubernetes: IsConfigMapKey)


class TolerationConfig(StrictModel):
    """One pod toleration (Kubernetes ``Toleration``) for the training nodes' taints."""

    key: str | None = Field(None, description="Taint key to tolerate; null with operator Exists tolerates all.")
    operator: Literal["Exists", "Equal"] = Field("Exists", description="Exists (any value) or Equal (value).")
    value: str | None = Field(None, description="Taint value (operator Equal only).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        "NoSchedule", description="Taint effect to tolerate; null tolerates every effect."
    )

    @model_validator(mode="after")
    def _value_needs_equal(self) -> TolerationConfig:
        if self.operator == "Exists" and self.value is not None:
            raise ValueError("value must be null when operator is Exists")
        return self


class SecretEnvConfig(StrictModel):
    """Environment variables read from a Kubernetes Secret by reference (the value never enters a manifest)."""

    name: str = Field("lmforge-s3", pattern=DNS_SUBDOMAIN, description="Secret name in the job's namespace.")
    keys: list[str] = Field(
        default_factory=lambda: ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"],
        min_length=1,
        description="Secret keys; each becomes the env var of the same name (the names boto3 reads).",
    )
    optional: bool = Field(False, description="Start the pods even when the Secret or a key is missing.")

    @model_validator(mode="after")
    def _keys_are_env_names(self) -> SecretEnvConfig:

        bad = [k for k in self.keys if not re.match(_ENV_NAME, k)]
        if bad:
            raise ValueError(f"keys must be valid env var names, got {bad}")
        return self


class SecretKeyRefConfig(StrictModel):
    """One env var read from a key of a Kubernetes Secret (``valueFrom.secretKeyRef``); its value never enters a
    manifest."""

    secret: str = Field(pattern=DNS_SUBDOMAIN, max_length=253, description="Secret name in the job's namespace.")
    key: str = Field(pattern=_SECRET_KEY, max_length=253, description="Key of the value in the Secret.")
    optional: bool = Field(False, description="Start the pods even when the Secret or the key is missing.")


# The runtimes manifests/trainer-runtimes installs (restricted pods on every Trainer release), by `runtime`.
LMFORGE_TRAINER_RUNTIMES = {
    "torch-distributed": "lmforge-torch-distributed",
    "deepspeed-distributed": "lmforge-deepspeed-distributed",
}
# The `runtime` (how training starts) of each runtime name lmforge knows: Kubeflow's stock ones and lmforge's.
_RUNTIME_OF_NAME = {
    **{name: name for name in LMFORGE_TRAINER_RUNTIMES},
    **{lmforge: stock for stock, lmforge in LMFORGE_TRAINER_RUNTIMES.items()},
}


Accelerator = Literal["H200", "H100", "A100", "L40S", "A10G", "L4"]
"""The GPU models :data:`lmforge.train.mfu.PEAK_FLOPS_BF16` knows the peak FLOP/s and memory of (a test keeps them
equal)."""


def _default_tolerations() -> list[TolerationConfig]:
    return [TolerationConfig(**GPU_POOL_TOLERATION)]


class LaunchConfig(StrictModel):
    """Multi-node training as a Kubeflow Trainer ``TrainJob`` or a Training Operator ``PyTorchJob``."""

    backend: Literal["trainjob", "pytorchjob"] = Field(
        "trainjob",
        description="trainjob (Kubeflow Trainer v2, trainer.kubeflow.org/v1alpha1) or pytorchjob (Training "
        "Operator v1, kubeflow.org/v1) for older clusters.",
    )
    runtime: Literal["torch-distributed", "deepspeed-distributed"] = Field(
        "torch-distributed",
        description="How a TrainJob starts training, as the Kubeflow runtime of that name does: torch-distributed "
        "(torchrun; DeepSpeed runs under it too) or deepspeed-distributed (MPI launcher). The runtime the TrainJob "
        "refers to is runtime_name. A PyTorchJob always launches with torchrun.",
    )
    runtime_name: str | None = Field(
        None,
        pattern=DNS_SUBDOMAIN,
        max_length=253,
        description="Name of the runtime the TrainJob refers to (runtimeRef). null: lmforge's runtime for `runtime` "
        "(lmforge-torch-distributed, lmforge-deepspeed-distributed), whose pods meet Pod Security restricted on "
        "every Trainer release; a cluster admin installs them once with `kubectl apply -k "
        "manifests/trainer-runtimes`. Kubeflow's stock torch-distributed / deepspeed-distributed work too, but on "
        "Trainer v2.1 their pods are not restricted: a v2.1 TrainJob cannot set a securityContext, its pods get the "
        "runtime's. A runtime of your own needs the stock one's replicated jobs and `node` container.",
    )
    runtime_kind: Literal["ClusterTrainingRuntime", "TrainingRuntime"] = Field(
        "ClusterTrainingRuntime",
        description="Kind of the referenced runtime: ClusterTrainingRuntime (cluster-wide, as lmforge's are) or "
        "TrainingRuntime (in the job's namespace).",
    )
    namespace: str | None = Field(
        None,
        pattern=DNS_LABEL,
        max_length=63,
        description="Namespace of the job; null: the step's own namespace (its service account's, e.g. the "
        "Kubeflow profile the run belongs to), outside a pod the kubeconfig context's.",
    )
    service_account: str | None = Field(
        "lmforge-worker",
        pattern=DNS_SUBDOMAIN,
        description="Service account of the training pods (null: the namespace's default). manifests/ creates "
        "lmforge-worker with no API token mounted and no RBAC: the pods only need S3.",
    )
    trainjob_pod_overrides: Literal["auto", "runtimePatches", "podTemplateOverrides"] = Field(
        "auto",
        description="How a TrainJob places its pods (selector, tolerations, service account, /dev/shm): "
        "runtimePatches (Kubeflow Trainer >= v2.2) or podTemplateOverrides (Trainer v2.1, as in Kubeflow 1.11); "
        "auto reads which one the cluster serves from its OpenAPI v3 document for trainer.kubeflow.org/v1alpha1.",
    )
    accelerator: Accelerator = Field(
        "H100",
        description="GPU model of the nodes the training steps land on: H200, H100, A100 (80 GB), L40S, A10G or "
        "L4. Preflight plans every training stage on it (hours from its dense bf16 peak FLOP/s, memory against its "
        "size; both from the vendor data sheets, lmforge.train.mfu) and refuses a plan that does not fit. It "
        "places nothing: node_selector and the pipeline's gpu_* parameters choose the nodes.",
    )
    num_nodes: int = Field(1, ge=1, description="Training nodes (pods); more than 1 launches a job.")
    gpus_per_node: int = Field(1, ge=0, description=f"{GPU_RESOURCE} per node; also the processes per node.")
    cpu_per_node: str | None = Field(None, pattern=QUANTITY, description="CPU request per node, e.g. '32'.")
    memory_per_node: str | None = Field(None, pattern=QUANTITY, description="Memory request per node, e.g. '200Gi'.")
    shm_size: str | None = Field(
        "16Gi", pattern=QUANTITY, description="Size of the in-memory /dev/shm (NCCL, data loaders); null: none."
    )
    node_selector: dict[str, str] = Field(
        default_factory=lambda: dict(GPU_POOL_NODE_SELECTOR), description="Node labels the training pods need."
    )
    tolerations: list[TolerationConfig] = Field(
        default_factory=_default_tolerations, description="Taints of the GPU node pool the pods tolerate."
    )
    priority_class: str | None = Field(
        "lmforge-training",
        pattern=DNS_SUBDOMAIN,
        description="PriorityClass of PyTorchJob pods (a TrainJob takes it from its runtime: its patches "
        "cannot set it).",
    )
    s3_credentials: SecretEnvConfig | None = Field(
        default_factory=SecretEnvConfig, description="S3 credentials as env vars from a Secret (null: none, e.g. IRSA)."
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Plain env vars for the training processes (e.g. AWS_ENDPOINT_URL), written into the job "
        "manifest as values. A name that may hold a credential (containing KEY, TOKEN, SECRET, PASS, PWD, CRED, "
        "AUTH, COOKIE, SESSION, PRIVATE, SALT, DSN, CONNECTION_STRING) or a URL with a password is refused: "
        "pass it in secret_env.",
    )
    secret_env: dict[str, SecretKeyRefConfig] = Field(
        default_factory=dict,
        description="Env vars read from Secrets by reference: env var name -> {secret, key}, e.g. "
        "{WANDB_API_KEY: {secret: wandb, key: api-key}} for a Secret made with `kubectl create secret generic "
        "wandb --from-literal=api-key=...`. The manifest holds the reference, never the value.",
    )
    backoff_limit: int = Field(3, ge=0, description="PyTorchJob pod restarts before the job fails.")
    active_deadline_s: int | None = Field(None, gt=0, description="Server-side limit on the job's run time.")
    wait_timeout_s: int | None = Field(
        None, gt=0, description="Give up waiting (and delete the job) after this many seconds; null: never."
    )
    watch_window_s: int = Field(
        30, gt=0, description="Seconds per watch request; pods and their logs are looked for between them."
    )
    delete_on_success: bool = Field(False, description="Delete the job (and its pods) once it has succeeded.")
    recreate_failed: bool = Field(
        True, description="A retried step finding its job Failed deletes and resubmits it (resume: auto)."
    )
    log_tail_lines: int = Field(50, gt=0, description="Log lines per pod carried in a failure's error message.")

    @model_validator(mode="after")
    def _check(self) -> LaunchConfig:
        if self.backend == "pytorchjob" and self.runtime != "torch-distributed":
            raise ValueError(
                f"runtime {self.runtime!r} is a TrainJob runtime; a PyTorchJob always launches with torchrun "
                "(DeepSpeed runs under it): use runtime 'torch-distributed' or backend 'trainjob'"
            )
        if self.backend == "pytorchjob" and self.runtime_name is not None:
            raise ValueError("runtime_name names a TrainJob runtime; a PyTorchJob has none: leave it null")
        starts = _RUNTIME_OF_NAME.get(self.runtime_name or "", self.runtime)
        if starts != self.runtime:
            raise ValueError(
                f"runtime_name {self.runtime_name!r} starts training as {starts} does, but runtime is "
                f"{self.runtime!r}: set runtime: {starts}"
            )

        s3_keys = self.s3_credentials.keys if self.s3_credentials else []
        for name, value in self.env.items():
            if not re.match(_ENV_NAME, name):
                raise ValueError(f"env: {name!r} is not a valid env var name")
            fragment = credential_fragment(name)
            why = (
                "its value is a URL with a password"
                if URL_PASSWORD.search(value)
                else f"its name contains {fragment!r}"
                if fragment
                else "it is one of s3_credentials.keys"
                if name in s3_keys
                else None
            )
            if why:
                raise ValueError(
                    f"env: {name!r} may hold a credential ({why}), and env values are written into the job "
                    f"manifest in clear. Pass it by Secret reference: create the Secret (kubectl create secret "
                    f"generic <secret> --from-literal=<key>=...) and set secret_env: {{{name}: {{secret: <secret>, "
                    "key: <key>}} (S3 keys: s3_credentials)"
                )
        for name in self.secret_env:
            if not re.match(_ENV_NAME, name):
                raise ValueError(f"secret_env: {name!r} is not a valid env var name")
            if name in self.env or name in s3_keys:
                where = "env" if name in self.env else "s3_credentials.keys"
                raise ValueError(f"secret_env: {name!r} is also set in {where}; set it in one place")
        return self

    @property
    def trainjob_runtime(self) -> str:
        """Name of the runtime a TrainJob refers to: ``runtime_name``, else lmforge's runtime for ``runtime``."""
        return self.runtime_name or LMFORGE_TRAINER_RUNTIMES[self.runtime]
