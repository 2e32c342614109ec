"""Pure builders for serving a release on KServe: ``InferenceService``, the lmforge ``ServingRuntime``, Triton.

Nothing here talks to a cluster. The objects follow the CRDs of KServe v0.15.2 (what Kubeflow 1.11 ships) and
v0.20.0 (copies under ``tests/data/crds/kserve/``, where the tests validate every builder's output strictly):

* runtime ``lmforge``: a namespaced ``ServingRuntime`` (:func:`build_serving_runtime`) runs the serve image
  (``python -m lmforge.serve /mnt/models``); the ``InferenceService`` points ``storageUri`` at the release's served
  ONNX directory (``int8_dynamic`` on CPU when the release has it, else ``onnx_fp32``), which KServe's storage
  initializer downloads to ``/mnt/models``;
* runtime ``triton``: the stock ``kserve-tritonserver`` ``ClusterServingRuntime``; ``storageUri`` points at a
  Triton model repository (:func:`write_triton_repository`: ``<repo>/<model>/config.pbtxt`` and
  ``<repo>/<model>/1/model.onnx`` or ``model.plan``);
* runtime ``huggingface``: the stock ``kserve-huggingfaceserver`` ``ClusterServingRuntime``; ``storageUri`` points at
  the release's Hugging Face ``student`` directory, and the predictor's ``args`` (:func:`huggingface_args`, appended
  to the runtime's by KServe) choose the backend: vLLM on a GPU, transformers on CPU.

A GPU predictor gets ``nvidia.com/gpu`` limits and the GPU pool's node selector and tolerations, like the GPU
training steps. Every pod meets Pod Security ``restricted`` (:mod:`lmforge.pod_security`); the predictor mounts no
service account token, and the lmforge runtime's root filesystem is read-only (``/tmp`` is an emptyDir).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import onnx

from lmforge.cluster import GPU_POOL_NODE_SELECTOR, GPU_POOL_TOLERATION, GPU_RESOURCE
from lmforge.config.serve import ServeConfig
from lmforge.errors import ConfigError, InputDataError
from lmforge.onnx_runtime import external_data_files
from lmforge.pod_security import container_security_context, pod_security_context, tmp_mount, tmp_volume
from lmforge.serve.model_dir import INT8_DYNAMIC, ONNX_FP32, STUDENT

API_VERSION = "serving.kserve.io/v1beta1"
RUNTIME_API_VERSION = "serving.kserve.io/v1alpha1"
LMFORGE_RUNTIME = "lmforge-onnx"
LMFORGE_FORMAT = {"name": "lmforge", "version": "1"}
TRITON_RUNTIME = "kserve-tritonserver"
TRITON_FORMAT = {"name": "triton", "version": "2"}
TRITON_USER = 1000  # the stock Triton image's default user is root; its triton-server user is uid 1000
HUGGINGFACE_RUNTIME = "kserve-huggingfaceserver"
HUGGINGFACE_FORMAT = {"name": "huggingface", "version": "1"}
ENGINE = "engine"
PREDICTOR_OPTIONS = (
    "threads",
    "ort_spinning",
    "max_batch_size",
    "max_wait_ms",
    "max_queue",
    "max_prompts_per_request",
    "max_request_bytes",
    "default_max_tokens",
    "max_tokens_limit",
    "default_temperature",
)
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MODEL = "lmforge.io/model"
LABEL_VERSION = "lmforge.io/version"
TritonPlatform = Literal["onnxruntime_onnx", "tensorrt_plan"]
TRITON_FILES: dict[str, str] = {"onnxruntime_onnx": "model.onnx", "tensorrt_plan": "model.plan"}
_TRITON_TYPES = {
    onnx.TensorProto.FLOAT: "TYPE_FP32",
    onnx.TensorProto.FLOAT16: "TYPE_FP16",
    onnx.TensorProto.BFLOAT16: "TYPE_BF16",
    onnx.TensorProto.INT64: "TYPE_INT64",
    onnx.TensorProto.INT32: "TYPE_INT32",
    onnx.TensorProto.INT8: "TYPE_INT8",
    onnx.TensorProto.UINT8: "TYPE_UINT8",
    onnx.TensorProto.BOOL: "TYPE_BOOL",
}


def service_name(cfg: ServeConfig, model_name: str) -> str:
    """The InferenceService name: ``cfg.service_name``, else the model name as a DNS label."""
    if cfg.service_name:
        return cfg.service_name
    name = re.sub(r"[^a-z0-9-]+", "-", model_name.lower()).strip("-")[:45].rstrip("-")
    if not name or not name[0].isalpha():
        raise ConfigError(f"model name {model_name!r} makes no InferenceService name; set serve.service_name")
    return name


@dataclass(frozen=True)
class _Runtime:
    """What an InferenceService names for one of ``ServeConfig.runtime``'s runtimes."""

    name: str
    model_format: Mapping[str, str]
    protocol: str
    run_as_user: int | None = None


_RUNTIMES = {
    "lmforge": _Runtime(LMFORGE_RUNTIME, LMFORGE_FORMAT, "v1"),
    "triton": _Runtime(TRITON_RUNTIME, TRITON_FORMAT, "v2", TRITON_USER),
    "huggingface": _Runtime(HUGGINGFACE_RUNTIME, HUGGINGFACE_FORMAT, "v1"),
}


def _served_order(cfg: ServeConfig, engine_built: bool) -> list[str]:
    """The release folders the runtime can serve, preferred first."""
    if cfg.resolved_runtime == "triton":
        return [ENGINE, ONNX_FP32] if engine_built else [ONNX_FP32]
    if cfg.resolved_runtime == "huggingface":
        return [STUDENT]
    return [INT8_DYNAMIC, ONNX_FP32] if cfg.prefer_int8 and cfg.device == "cpu" else [ONNX_FP32]


def served_artifact(release_manifest: Mapping[str, Any], cfg: ServeConfig, *, engine_built: bool = True) -> str:
    """The release folder the runtime serves: see the module docstring; raise if the release has none.

    ``engine_built`` False (the engine's ``status.json`` says skipped) leaves the engine out for Triton.
    """
    artifacts = release_manifest.get("artifacts") or {}
    order = _served_order(cfg, engine_built)
    for name in order:
        if name in artifacts:
            return name
    raise InputDataError(
        f"release {release_manifest.get('version')}: nothing for the {cfg.resolved_runtime} runtime to serve "
        f"(needs one of {order}; it holds {sorted(artifacts)})"
    )


def _resources(cfg: ServeConfig) -> dict[str, Any]:
    r = cfg.resources
    limits = {k: v for k, v in (("cpu", r.cpu_limit), ("memory", r.memory_limit)) if v is not None}
    if cfg.device == "gpu":
        limits[GPU_RESOURCE] = str(cfg.gpu_count)
    out: dict[str, Any] = {"requests": {"cpu": r.cpu_request, "memory": r.memory_request}}
    if limits:
        out["limits"] = limits
    return out


def _labels(model_name: str, version: str | None) -> dict[str, str]:
    labels = {LABEL_PART_OF: "lmforge", LABEL_MODEL: re.sub(r"[^A-Za-z0-9._-]", "-", model_name)[:63]}
    if version:
        labels[LABEL_VERSION] = re.sub(r"[^A-Za-z0-9._-]", "-", version)[:63]
    return labels


def _metadata(name: str, cfg: ServeConfig, labels: Mapping[str, str]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": dict(labels)}
    if cfg.namespace:
        meta["namespace"] = cfg.namespace
    return meta


def huggingface_args(cfg: ServeConfig, *, model_name: str, max_model_len: int) -> list[str]:
    """The ``kserve-huggingfaceserver`` arguments for ``cfg``: vLLM on a GPU, the transformers backend on CPU.

    KServe appends them to the stock runtime's own (``--model_name={{.Name}}``), and the last one wins, so the
    OpenAI ``model`` field is ``model_name``, as with ``lmforge serve``. The transformers backend gets the task: it
    infers it from the architecture's name, and a GPT-2 student's ``GPT2LMHeadModel`` matches none of its suffixes.
    vLLM's own options keep their dashes: the server reads its arguments with ``parse_known_args``, which skips vLLM's
    underscore-to-dash rewriting, so ``--gpu_memory_utilization`` would be dropped without a word.

    Args:
        cfg: device, ``hf_dtype``, ``hf_gpu_memory_utilization``.
        model_name: the name in the routes.
        max_model_len: the model's context (prompt plus new tokens).
    """
    dtype = cfg.hf_dtype if cfg.device == "gpu" else "float32"
    args = [f"--model_name={model_name}", f"--max_model_len={max_model_len}", f"--dtype={dtype}"]
    if cfg.device == "gpu":
        return [*args, "--backend=vllm", f"--gpu-memory-utilization={cfg.hf_gpu_memory_utilization}"]
    return [*args, "--backend=huggingface", "--task=text_generation"]


def build_inference_service(
    cfg: ServeConfig,
    *,
    storage_uri: str,
    model_name: str,
    version: str | None = None,
    args: Sequence[str] = (),
) -> dict[str, Any]:
    """The ``InferenceService`` serving ``storage_uri`` with the runtime ``cfg`` resolves to.

    Args:
        cfg: runtime, device, resources, replicas, canary share.
        storage_uri: what KServe downloads to ``/mnt/models``: the served ONNX directory of the release (lmforge
            runtime), the Triton model repository (triton runtime) or the student directory (huggingface runtime).
        model_name: the release's model name (labels; the service name unless ``cfg.service_name``).
        version: the release version (a label).
        args: the model server's arguments (:func:`huggingface_args`); none: the runtime's own.
    """
    name = service_name(cfg, model_name)
    runtime = _RUNTIMES[cfg.resolved_runtime]
    model: dict[str, Any] = {
        "modelFormat": dict(runtime.model_format),
        "runtime": runtime.name,
        "storageUri": storage_uri,
        "protocolVersion": runtime.protocol,
        "resources": _resources(cfg),
    }
    if args:
        model["args"] = list(args)
    model["securityContext"] = container_security_context(run_as_user=runtime.run_as_user)
    predictor: dict[str, Any] = {
        "minReplicas": cfg.min_replicas,
        "maxReplicas": cfg.max_replicas,
        "automountServiceAccountToken": False,  # the predictor needs nothing of the Kubernetes API
        "securityContext": pod_security_context(),
        "model": model,
    }
    if cfg.scale_target is not None:
        predictor["scaleMetric"] = "concurrency"
        predictor["scaleTarget"] = cfg.scale_target
    if cfg.canary_traffic_percent is not None:
        predictor["canaryTrafficPercent"] = cfg.canary_traffic_percent
    if cfg.service_account:
        predictor["serviceAccountName"] = cfg.service_account
    if cfg.device == "gpu":
        predictor["nodeSelector"] = dict(GPU_POOL_NODE_SELECTOR if cfg.node_selector is None else cfg.node_selector)
        predictor["tolerations"] = _gpu_tolerations(cfg)
    return {
        "apiVersion": API_VERSION,
        "kind": "InferenceService",
        "metadata": _metadata(name, cfg, _labels(model_name, version)),
        "spec": {"predictor": predictor},
    }


def _gpu_tolerations(cfg: ServeConfig) -> list[dict[str, Any]]:
    """A GPU predictor's tolerations: ``serve.tolerations``, else (neither it nor the pipeline says) the GPU pool's."""
    if cfg.tolerations is None:
        return [dict(GPU_POOL_TOLERATION)]
    return [t.model_dump(exclude_none=True) for t in cfg.tolerations]


def build_serving_runtime(cfg: ServeConfig) -> dict[str, Any]:
    """The namespaced ``ServingRuntime`` ``lmforge-onnx`` that runs the lmforge predictor image.

    KServe fills ``{{.Name}}`` with the InferenceService name, so the routes are ``/v2/models/<service>/infer``.
    """
    if cfg.image is None:
        raise ConfigError(
            "serve.image: no predictor image for the lmforge runtime; set serve.image or pass the serve stage's "
            "predictor_image (the pipeline passes the images/serve image it was compiled with)"
        )
    options = json.dumps({k: getattr(cfg, k) for k in PREDICTOR_OPTIONS}, sort_keys=True, separators=(",", ":"))
    container = {
        "name": "kserve-container",
        "image": cfg.image,
        "command": ["python", "-m", "lmforge.serve"],
        "args": [
            *("/mnt/models", "--host", "0.0.0.0", "--port", "8080"),
            *("--model-name", "{{.Name}}", "--overrides", options),
        ],
        "ports": [{"containerPort": 8080, "protocol": "TCP"}],
        # A ServingRuntime has no pod-level securityContext: the container meets Pod Security restricted alone.
        "securityContext": container_security_context(read_only_root=True),
        "volumeMounts": [tmp_mount()],
        "resources": _resources(cfg),
    }
    return {
        "apiVersion": RUNTIME_API_VERSION,
        "kind": "ServingRuntime",
        "metadata": _metadata(LMFORGE_RUNTIME, cfg, {LABEL_PART_OF: "lmforge"}),
        "spec": {
            "annotations": {"prometheus.kserve.io/port": "8080", "prometheus.kserve.io/path": "/metrics"},
            "supportedModelFormats": [{**LMFORGE_FORMAT, "autoSelect": True, "priority": 1}],
            "protocolVersions": ["v1", "v2"],
            "containers": [container],
            "volumes": [tmp_volume()],
        },
    }


# ---- Triton model repository --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output as Triton sees it: name, data type and dimensions (-1 where dynamic)."""

    name: str
    data_type: str
    dims: tuple[int, ...]


def graph_signature(onnx_file: str | Path) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Inputs and outputs of an ONNX graph (weights not loaded), with Triton data types."""
    model = onnx.load(str(onnx_file), load_external_data=False)
    initializers = {t.name for t in model.graph.initializer}

    def spec(value: onnx.ValueInfoProto) -> TensorSpec:
        tensor = value.type.tensor_type
        if tensor.elem_type not in _TRITON_TYPES:
            raise InputDataError(f"{onnx_file}: {value.name} has ONNX element type {tensor.elem_type}, not for Triton")
        if not tensor.HasField("shape"):
            raise InputDataError(f"{onnx_file}: {value.name} has no shape; Triton needs the rank")
        dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim)
        return TensorSpec(value.name, _TRITON_TYPES[tensor.elem_type], dims)

    inputs = [spec(v) for v in model.graph.input if v.name not in initializers]
    return inputs, [spec(v) for v in model.graph.output]


def triton_config(
    model_name: str,
    platform: TritonPlatform,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    *,
    max_batch_size: int,
    preferred_batch_sizes: Sequence[int],
    max_queue_delay_us: int,
    gpu: bool,
) -> str:
    """``config.pbtxt`` (protobuf text of Triton's ``ModelConfig``) with dynamic batching over the first axis.

    The first dimension of every tensor must be dynamic (the batch); Triton's dims leave it out.
    """
    if bad := [t.name for t in (*inputs, *outputs) if not t.dims or t.dims[0] != -1]:
        raise InputDataError(f"{model_name}: tensors {bad} have no dynamic batch dimension; Triton cannot batch them")

    def tensors(kind: str, specs: Sequence[TensorSpec]) -> list[str]:
        lines = [f"{kind} ["]
        for i, t in enumerate(specs):
            dims = ", ".join(str(d) for d in t.dims[1:])
            lines += ["  {", f'    name: "{t.name}"', f"    data_type: {t.data_type}", f"    dims: [ {dims} ]"]
            lines.append("  }," if i < len(specs) - 1 else "  }")
        return [*lines, "]"]

    preferred = ", ".join(str(s) for s in sorted({s for s in preferred_batch_sizes if s <= max_batch_size}))
    lines = [f'name: "{model_name}"', f'platform: "{platform}"', f"max_batch_size: {max_batch_size}"]
    lines += tensors("input", inputs) + tensors("output", outputs)
    lines += ["dynamic_batching {"]
    if preferred:
        lines.append(f"  preferred_batch_size: [ {preferred} ]")
    lines += [f"  max_queue_delay_microseconds: {max_queue_delay_us}", "}"]
    lines += ["instance_group [", "  {", "    count: 1", f"    kind: {'KIND_GPU' if gpu else 'KIND_CPU'}", "  }", "]"]
    return "\n".join(lines) + "\n"


def write_triton_repository(
    repo_dir: str | Path,
    *,
    model_name: str,
    model_file: str | Path,
    platform: TritonPlatform,
    cfg: ServeConfig,
    signature_onnx: str | Path | None = None,
) -> Path:
    """Write ``<repo_dir>/<model_name>/config.pbtxt`` and ``<model_name>/1/model.onnx|model.plan``.

    Args:
        repo_dir: the model repository root (what the InferenceService's ``storageUri`` points at).
        model_name: the Triton model name (the route ``/v2/models/<model_name>/infer``).
        model_file: the ONNX graph (copied with its external data) or the TensorRT ``engine.plan``.
        platform: ``onnxruntime_onnx`` or ``tensorrt_plan``.
        cfg: batching (``max_batch_size``, ``triton_preferred_batch_sizes``, ``max_wait_ms``) and device.
        signature_onnx: the ONNX graph whose inputs and outputs the model has; default ``model_file`` (for an
            engine: the ONNX file it was built from).

    Returns:
        The model's folder.
    """
    model_file = Path(model_file)
    source = Path(signature_onnx) if signature_onnx is not None else model_file
    if platform == "tensorrt_plan" and signature_onnx is None:
        raise ConfigError("a TensorRT engine needs signature_onnx: the ONNX graph it was built from")
    inputs, outputs = graph_signature(source)
    folder = Path(repo_dir) / model_name
    version = folder / "1"
    version.mkdir(parents=True, exist_ok=True)
    shutil.copy2(model_file, version / TRITON_FILES[platform])
    if platform == "onnxruntime_onnx":
        for extra in external_data_files(model_file):  # Triton loads external data from beside model.onnx
            shutil.copy2(extra, version / extra.name)
    config = triton_config(
        model_name,
        platform,
        inputs,
        outputs,
        max_batch_size=cfg.max_batch_size,
        preferred_batch_sizes=cfg.triton_preferred_batch_sizes,
        max_queue_delay_us=round(cfg.max_wait_ms * 1000),
        gpu=cfg.device == "gpu",
    )
    (folder / "config.pbtxt").write_text(config, encoding="utf-8")
    return folder
