"""Multi-node training on Kubernetes: Kubeflow Trainer ``TrainJob`` or Training Operator ``PyTorchJob``.

Inside one pod a stage runs ``torchrun --nproc_per_node=<GPUs>`` (:func:`single_pod_command`); for more
than one node the stage step submits a job (:func:`build_job`) and waits for it (:func:`launch_and_wait`),
adopting the job a previous attempt of the same step created. See docs/launch.md.
"""

from lmforge.launch.client import (
    LaunchCancelled,
    LaunchError,
    LaunchResult,
    LaunchTimeout,
    job_state,
    kube_api_client,
    launch,
    launch_and_wait,
)
from lmforge.launch.manifests import (
    PYTORCHJOB,
    TRAINJOB,
    JobKind,
    build_job,
    build_pytorchjob,
    build_trainjob,
    job_name,
    single_pod_command,
    stage_args,
)

__all__ = [
    "PYTORCHJOB",
    "TRAINJOB",
    "JobKind",
    "LaunchCancelled",
    "LaunchError",
    "LaunchResult",
    "LaunchTimeout",
    "build_job",
    "build_pytorchjob",
    "build_trainjob",
    "job_name",
    "job_state",
    "kube_api_client",
    "launch",
    "launch_and_wait",
    "single_pod_command",
    "stage_args",
]
