"""Multi-node training on Kubernetes: Kubeflow Trainer ``TrainJob`` or Training Operator ``PyTorchJob``.

Inside one pod a stage runs ``torchrun --nproc_per_node=<GPUs>`` (:func:`single_pod_command`); for more
than one node the stage step submits a job (:func:`build_job`) and waits for it (:func:`launch_and_wait`),
adopting the job a previous attempt of the same step created. A training component calls
:func:`run_training_stage`, which picks one of the three (in process, torchrun in the pod, job) from its
:class:`~lmforge.config.LaunchConfig`. See docs/launch.md.
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
from lmforge.launch.discovery import check_training_api
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
    world_size,
)
from lmforge.launch.stage_runner import (
    fetch_artifact,
    parse_launch,
    publish_artifact,
    read_result,
    run_stage_uris,
    run_training_stage,
    write_result,
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
    "check_training_api",
    "fetch_artifact",
    "job_name",
    "job_state",
    "kube_api_client",
    "launch",
    "launch_and_wait",
    "parse_launch",
    "publish_artifact",
    "read_result",
    "run_stage_uris",
    "run_training_stage",
    "single_pod_command",
    "stage_args",
    "world_size",
    "write_result",
]
