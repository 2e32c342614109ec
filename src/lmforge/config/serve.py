"""Config of the ``serve`` stage and of ``lmforge serve``: the predictor, its batching, and the InferenceService."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lmforge.cluster import GPU_POOL_NODE_SELECTOR, GPU_POOL_TOLERATION, GPU_RESOURCE
from lmforge.config.base import DNS_LABEL, DNS_SUBDOMAIN, QUANTITY, StrictModel
from lmforge.config.launch import TolerationConfig


class ResourcesConfig(StrictModel):
    """CPU and memory of one predictor replica (Kubernetes resource quantities)."""

    cpu_request: str = Field("1", pattern=QUANTITY, description="CPU request per replica, e.g. '2' or '500m'.")
    memory_request: str = Field("1Gi", pattern=QUANTITY, description="Memory request per replica, e.g. '2Gi'.")
    cpu_limit: str | None = Field("2", pattern=QUANTITY, description="CPU limit per replica (null: none).")
    memory_limit: str | None = Field("2Gi", pattern=QUANTITY, description="Memory limit per replica (null: none).")


class ServeConfig(StrictModel):
    """The lmforge predictor (ONNX Runtime, KV cache, dynamic batching) and its KServe ``InferenceService``."""

    model_name: str | None = Field(
        None,
        pattern=r"^[a-z0-9][a-z0-9._-]*$",
        description="Name in the routes (/v2/models/<name>/infer, the OpenAI 'model' field); null: the release's "
        "model name, else the model directory's name.",
    )
    prefer_int8: bool = Field(
        True,
        description="On CPU serve the release's dynamic INT8 model (int8_dynamic) when it has one; else the FP32 "
        "ONNX model (onnx_fp32). A release holds an INT8 model only if its accuracy gate accepted it.",
    )
    threads: int | None = Field(
        None, ge=1, description="ONNX Runtime intra-op threads per predictor; null: ONNX Runtime's default (all cores)."
    )
    ort_spinning: bool = Field(
        False,
        description="Let ONNX Runtime's idle threads busy-wait between decode steps; off leaves the cores to the "
        "HTTP server and tokenizer in between (faster on a few shared cores).",
    )
    max_batch_size: int = Field(
        8, ge=1, le=256, description="Most requests generated together in one batch; 1 turns dynamic batching off."
    )
    max_wait_ms: float = Field(
        5.0,
        ge=0.0,
        le=1000.0,
        description="How long the first queued request waits for others to join its batch before it starts.",
    )
    max_queue: int = Field(
        256,
        ge=1,
        description="Prompts waiting for a batch at most; a request whose prompts do not all fit is refused whole "
        "with 503 (before any of them is tokenized) until the queue drains.",
    )
    max_prompts_per_request: int = Field(
        32,
        ge=1,
        description="Most prompts in one request (v1 instances, v2 text elements, an OpenAI prompt list); more is "
        "refused with 400 before any prompt is read. At most max_queue.",
    )
    max_request_bytes: int = Field(
        1_048_576,
        ge=1024,
        description="Largest request body in bytes; a larger one is refused with 413 before it is read in full.",
    )
    default_max_tokens: int = Field(
        32, ge=1, description="New tokens per request when the request names none (max_tokens)."
    )
    max_tokens_limit: int = Field(
        256, ge=1, description="Largest max_tokens a request may ask for; more is refused with 400."
    )
    default_temperature: float = Field(
        0.0,
        ge=0.0,
        le=2.0,
        description="Sampling temperature when the request names none; 0 decodes greedily (deterministic).",
    )
    # Kubernetes side: the InferenceService the serve stage writes and, with apply, creates.
    runtime: Literal["auto", "lmforge", "triton", "huggingface"] = Field(
        "auto",
        description="lmforge: the lmforge predictor image (ONNX Runtime, CPU or GPU); triton: the stock "
        "kserve-tritonserver runtime with a Triton model repository (TensorRT engine, or ONNX on a GPU); "
        "huggingface: the stock kserve-huggingfaceserver runtime on the release's student/ (vLLM on a GPU, "
        "transformers on CPU); auto: triton when device is gpu, else lmforge.",
    )
    device: Literal["cpu", "gpu"] = Field(
        "cpu", description="Where the predictor runs; gpu adds the GPU limit, node selector and tolerations."
    )
    image: str | None = Field(
        None,
        min_length=1,
        description="Container image of the lmforge predictor (images/serve) the lmforge ServingRuntime runs; null: "
        "the one the pipeline was compiled with (the serve step's predictor_image).",
    )
    namespace: str | None = Field(
        None,
        pattern=DNS_LABEL,
        max_length=63,
        description="Namespace of the InferenceService; null: the step's own namespace.",
    )
    service_name: str | None = Field(
        None,
        pattern=DNS_LABEL,
        max_length=45,
        description="InferenceService name; null: the release's model name. KServe derives host names from it, "
        "so it stays short.",
    )
    service_account: str | None = Field(
        None,
        pattern=DNS_SUBDOMAIN,
        description="Service account of the predictor pods; it carries the S3 credentials KServe's storage "
        "initializer uses to download the model (null: the namespace's default).",
    )
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig, description="CPU and memory per replica.")
    gpu_count: int = Field(
        1,
        ge=1,
        description=f"{GPU_RESOURCE} per predictor replica when device is gpu (the training steps' GPUs are the "
        "pipeline's gpu_count).",
    )
    node_selector: dict[str, str] | None = Field(
        None,
        description="Node labels a GPU predictor needs (ignored on CPU); null: the pipeline's gpu_node_selector "
        f"(the GPU steps' pool), else {GPU_POOL_NODE_SELECTOR}.",
    )
    tolerations: list[TolerationConfig] | None = Field(
        None,
        description="Taints of the GPU node pool a GPU predictor tolerates; null: the pipeline's gpu_tolerations, "
        f"else {GPU_POOL_TOLERATION['key']} ({GPU_POOL_TOLERATION['operator']}, {GPU_POOL_TOLERATION['effect']}).",
    )
    min_replicas: int = Field(1, ge=0, description="Fewest predictor replicas (0 lets Knative scale to zero).")
    max_replicas: int = Field(1, ge=1, description="Most predictor replicas the autoscaler may start.")
    scale_target: int | None = Field(
        None, ge=1, description="Autoscaling target: concurrent requests per replica (null: KServe's default)."
    )
    canary_traffic_percent: int | None = Field(
        None,
        ge=0,
        le=100,
        description="Send this share of traffic to the new release and the rest to the revision serving now "
        "(null: all traffic to the new one).",
    )
    triton_preferred_batch_sizes: list[int] = Field(
        default_factory=lambda: [4, 8],
        description="Triton dynamic batching: batch sizes it prefers to form (those above max_batch_size are dropped).",
    )
    apply: bool = Field(
        False,
        description="Create or update the InferenceService in the cluster and wait for Ready (in a pod with "
        "KServe installed); off or outside a cluster only the manifest is written.",
    )
    apply_timeout_s: float = Field(600.0, gt=0.0, description="How long to wait for the InferenceService's Ready.")
    hf_dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto",
        description="Data type the huggingface runtime loads the weights in (its --dtype): auto is float32 on CPU "
        "and vLLM's choice on a GPU (float16 for a float32 model); float16 and bfloat16 need device gpu.",
    )
    hf_gpu_memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="Share of the GPU's memory vLLM may take for weights and KV cache (huggingface runtime on a "
        "GPU, vLLM's --gpu-memory-utilization); ignored on CPU.",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> ServeConfig:
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens {self.default_max_tokens} exceeds max_tokens_limit {self.max_tokens_limit}"
            )
        if self.max_prompts_per_request > self.max_queue:
            raise ValueError(
                f"max_prompts_per_request {self.max_prompts_per_request} exceeds max_queue {self.max_queue}: "
                "a request that large could never be queued"
            )
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} exceeds max_replicas {self.max_replicas}")
        if bad := [s for s in self.triton_preferred_batch_sizes if s < 1]:
            raise ValueError(f"triton_preferred_batch_sizes must be positive, got {bad}")
        if self.runtime == "huggingface" and self.device == "cpu" and self.hf_dtype not in ("auto", "float32"):
            raise ValueError(
                f"hf_dtype {self.hf_dtype} needs device gpu: the huggingface runtime's CPU backend (transformers) "
                "serves float32; set hf_dtype to auto or float32"
            )
        return self

    @property
    def resolved_runtime(self) -> Literal["lmforge", "triton", "huggingface"]:
        """The runtime ``auto`` stands for on this device."""
        if self.runtime == "auto":
            return "triton" if self.device == "gpu" else "lmforge"
        return self.runtime
