"""The pod specs that controllers make of the objects lmforge generates, for the Pod Security checks.

A stand-in for the controllers' merges (no cluster here): a patch is merged into the runtime's pod template the
way a strategic merge patch treats these fields of ``corev1.PodSpec`` (maps merge key by key; ``containers``,
``initContainers`` and ``volumes`` merge by ``name``, their patchMergeKey; other lists are replaced):

* TrainJob: Kubeflow Trainer applies ``spec.runtimePatches`` (>= v2.2) or ``spec.podTemplateOverrides`` (v2.1)
  to the pod template of each named replicated job of the ``ClusterTrainingRuntime``;
* InferenceService: KServe merges the predictor's ``model`` container into the ServingRuntime's container of the
  same role (``kserve-container``) and takes pod-level fields from the predictor and the runtime;
* PyTorchJob: each replica's ``template.spec`` is the pod spec as written.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

_BY_NAME = ("containers", "initContainers", "ephemeralContainers", "volumes")
# InferenceService predictor fields that are KServe's, not PodSpec's.
_PREDICTOR_ONLY = {
    *("minReplicas", "maxReplicas", "scaleMetric", "scaleMetricType", "scaleTarget", "canaryTrafficPercent"),
    *("containerConcurrency", "timeout", "batcher", "logger", "autoScaling", "deploymentStrategy", "model"),
    *("labels", "annotations", "workerSpec", "storageUris", "storageContainerName", "name"),
}


def merge(base: Any, patch: Any, key: str = "") -> Any:
    """``patch`` merged into ``base`` (see the module docstring); neither is changed."""
    if isinstance(base, Mapping) and isinstance(patch, Mapping):
        out = dict(copy.deepcopy(base))
        for k, v in patch.items():
            out[k] = merge(out[k], v, k) if k in out else copy.deepcopy(v)
        return out
    if key in _BY_NAME and isinstance(base, list) and isinstance(patch, list):
        named = {item["name"]: item for item in base}
        for item in patch:
            named[item["name"]] = merge(named[item["name"]], item) if item["name"] in named else item
        return list(named.values())
    return copy.deepcopy(patch)


def trainjob_pods(trainjob: Mapping[str, Any], runtime: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Replicated job name -> the pod spec its pods get: the runtime's template with the TrainJob's patches."""
    pods = {
        job["name"]: job["template"]["spec"]["template"]["spec"]
        for job in runtime["spec"]["template"]["spec"]["replicatedJobs"]
    }
    spec = trainjob["spec"]
    for patch in spec.get("runtimePatches", []):
        for job in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            pods[job["name"]] = merge(pods[job["name"]], job["template"]["spec"]["template"]["spec"])
    for override in spec.get("podTemplateOverrides", []):
        for target in override["targetJobs"]:
            pods[target["name"]] = merge(pods[target["name"]], override["spec"])
    return pods


def pytorchjob_pods(pytorchjob: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Replica type -> its pod spec."""
    return {kind: r["template"]["spec"] for kind, r in pytorchjob["spec"]["pytorchReplicaSpecs"].items()}


def serving_runtime_pod(runtime: Mapping[str, Any]) -> dict[str, Any]:
    """The pod fields a ServingRuntime contributes (its containers, volumes and host settings)."""
    spec = runtime["spec"]
    return {k: v for k, v in spec.items() if k in ("containers", "volumes", "hostIPC", "affinity", "nodeSelector")}


def predictor_pod(isvc: Mapping[str, Any], runtime: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The predictor's pod: pod fields of the predictor, its model as ``kserve-container`` merged into the runtime's."""
    predictor = isvc["spec"]["predictor"]
    pod = {k: v for k, v in predictor.items() if k not in _PREDICTOR_ONLY}
    model = {
        k: v
        for k, v in predictor["model"].items()
        if k not in ("modelFormat", "runtime", "storageUri", "protocolVersion")
    }
    pod = merge(pod, {"containers": [{"name": "kserve-container", **model}]})
    return merge(serving_runtime_pod(runtime), pod) if runtime is not None else pod
