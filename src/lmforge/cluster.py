"""Facts about the Kubernetes cluster every GPU workload of lmforge assumes, named once.

The GPU resource the pods request, and the GPU node pool they are placed on: the pool's node label and the
taint its nodes carry. The pipeline's GPU steps, a multi-node training job's pods (``launch``) and a GPU
predictor (``serve``) all default to this pool; ``components/gpu-pool`` labels and taints the nodes to match.
"""

from __future__ import annotations

from typing import Final

GPU_RESOURCE: Final = "nvidia.com/gpu"
"""The extended resource a GPU pod requests (the NVIDIA device plugin's)."""

GPU_POOL_NODE_SELECTOR: Final[dict[str, str]] = {"lmforge.io/pool": "gpu"}
"""The node labels of the GPU node pool; copy it before changing it."""

GPU_POOL_TOLERATION: Final[dict[str, str]] = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
"""The toleration of the GPU node pool's taint (any value of key ``nvidia.com/gpu``); copy it before changing it."""
