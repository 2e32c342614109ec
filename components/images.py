"""The one place that maps each component to its container image.

Tag = the lmforge package version. The registry prefix defaults to ``ghcr.io/lmforge`` and can be
overridden at compile time with ``LMFORGE_IMAGE_REGISTRY`` (e.g. your internal registry mirror).
"""

from __future__ import annotations

import os

from lmforge import __version__

DEFAULT_REGISTRY = "ghcr.io/lmforge"

# Runtime (images/<runtime>/Dockerfile) for every component.
RUNTIME_OF_COMPONENT: dict[str, str] = {
    "preflight": "cpu",
    "plan_shards": "cpu",
    "clean_shard": "cpu",
    "dedup_shards": "cpu",
    "merge_shards": "cpu",
    "clean": "cpu",
    "tokenize": "cpu",
    "pretrain": "train",
    "finetune_lora": "train",
    "distill": "train",
    "export_onnx": "cpu",
    "quantize_int8": "cpu",
    "build_tensorrt": "tensorrt",
    "evaluate": "cpu",
    "promote": "cpu",
}

GPU_RUNTIMES = frozenset({"train", "tensorrt"})


def runs_on_gpu(component: str) -> bool:
    """Whether ``component`` belongs on the GPU node pool (its runtime is a CUDA image)."""
    return RUNTIME_OF_COMPONENT[component] in GPU_RUNTIMES


def image_for(component: str) -> str:
    """Fully qualified image reference for ``component``."""
    registry = os.environ.get("LMFORGE_IMAGE_REGISTRY", DEFAULT_REGISTRY).rstrip("/")
    tag = __version__.split("+")[0]
    return f"{registry}/lmforge-{RUNTIME_OF_COMPONENT[component]}:{tag}"
