"""Whether the cluster serves the job kind a multi-node launch submits (API discovery, no CRD read rights needed)."""

from __future__ import annotations

from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.config import ConfigException
from urllib3.exceptions import HTTPError

from lmforge.config import LaunchConfig
from lmforge.launch.client import kube_api_client
from lmforge.launch.manifests import JOB_KINDS


def check_training_api(cfg: LaunchConfig, api_client: Any = None) -> str:
    """``ok`` when the cluster serves the job kind ``cfg.backend`` submits (its CRD is installed); a reason otherwise.

    Asks API discovery (``GET /apis/<group>/<version>``), which every authenticated user may read, rather
    than the cluster-scoped ``customresourcedefinitions`` that the pipeline's namespaced Role cannot get.

    Args:
        cfg: The launch configuration (only ``backend`` matters).
        api_client: Kubernetes API client; default: in-cluster service account, else ``~/.kube/config``.
    """
    kind = JOB_KINDS[cfg.backend]
    operator = "Kubeflow Trainer v2" if cfg.backend == "trainjob" else "the Kubeflow Training Operator v1"
    try:
        if api_client is None:
            api_client = kube_api_client()
        served = client.CustomObjectsApi(api_client).get_api_resources(kind.group, kind.version)
    except ApiException as exc:
        if exc.status == 404:
            return f"the cluster does not serve {kind.api_version} ({kind.kind}): install {operator}"
        return f"API discovery of {kind.api_version}: HTTP {exc.status} {exc.reason}"
    except (ConfigException, HTTPError, OSError) as exc:
        return f"cannot reach the Kubernetes API: {exc}"
    if kind.plural not in {resource.name for resource in served.resources}:
        return f"{kind.api_version} does not serve {kind.plural}: install {operator}"
    return "ok"
