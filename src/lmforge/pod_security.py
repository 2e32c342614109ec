"""The security settings of every pod lmforge generates: Pod Security Standards ``restricted``.

Pods run as non-root with the container runtime's default seccomp profile, no privilege escalation and no Linux
capabilities (``capabilities.drop: [ALL]``), and use only ``restricted`` volume types (emptyDir, Secret, ...).
A container with a read-only root filesystem gets a writable ``/tmp`` (emptyDir). Pods that need nothing of the
Kubernetes API (training pods, the predictor) do not mount a service account token.

lmforge's images run as the numeric user 10001, so ``runAsNonRoot`` needs no ``runAsUser``.
"""

from __future__ import annotations

from typing import Any

TMP_VOLUME = "tmp"
TMP_SIZE = "1Gi"


def pod_security_context() -> dict[str, Any]:
    """The pod-level ``securityContext``: non-root, ``RuntimeDefault`` seccomp profile."""
    return {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context(*, read_only_root: bool = False, run_as_user: int | None = None) -> dict[str, Any]:
    """A container's ``securityContext`` that meets ``restricted`` on its own (where no pod-level one can be set).

    Args:
        read_only_root: also ``readOnlyRootFilesystem`` (mount :func:`tmp_volume` at ``/tmp``).
        run_as_user: for an image whose default user is root (Triton's), the user to run as instead.
    """
    context: dict[str, Any] = {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if run_as_user is not None:
        context["runAsUser"] = run_as_user
    if read_only_root:
        context["readOnlyRootFilesystem"] = True
    return context


def tmp_volume() -> dict[str, Any]:
    """The writable ``/tmp`` of a container with a read-only root filesystem: an emptyDir on the node's disk."""
    return {"name": TMP_VOLUME, "emptyDir": {"sizeLimit": TMP_SIZE}}


def tmp_mount() -> dict[str, str]:
    """The mount of :func:`tmp_volume` at ``/tmp``."""
    return {"name": TMP_VOLUME, "mountPath": "/tmp"}
