"""Configs of the export stages: ``export_onnx``, ``quantize_int8``, ``build_tensorrt``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lmforge.config.base import StrictModel


class ExportConfig(StrictModel):
    """The ``export_onnx`` stage."""

    opset: int = Field(18, ge=17, le=23, description="ONNX opset version.")
    parity_tolerance: float = Field(
        1e-3, gt=0.0, description="Maximum |logit| difference allowed between ONNX Runtime and PyTorch."
    )
    with_past: bool = Field(
        True,
        description="Also export model.onnx, the decoder with a KV cache in and out (for generation, and the file "
        "optimum's ORTModelForCausalLM loads), next to decoder_model.onnx (no cache).",
    )


QuantOpType = Literal[
    "all",
    "Add",
    "AveragePool",
    "BatchNormalization",
    "Clip",
    "Conv",
    "ConvTranspose",
    "CumSum",
    "Flatten",
    "Gather",
    "GatherElements",
    "Gemm",
    "InstanceNormalization",
    "LayerNormalization",
    "MatMul",
    "MaxPool",
    "Mul",
    "Pad",
    "Relu",
    "Reshape",
    "Resize",
    "Slice",
    "Split",
    "Squeeze",
    "TopK",
    "Transpose",
    "Unsqueeze",
    "Where",
]
"""Op types with a Q/DQ rule in ONNX Runtime's QDQ registry, plus Add and Mul; ``all`` means every op type
ONNX Runtime can quantize (including those without a rule of their own, such as Softmax)."""


class QuantizeConfig(StrictModel):
    """The ``quantize_int8`` stage: dynamic INT8, calibrated Q/DQ INT8 and the accuracy gate."""

    calibration_sequences: int = Field(128, gt=0, description="Calibration sequences drawn from token shards.")
    calibration_seq_len: int = Field(64, gt=1, description="Tokens per calibration sequence.")
    calibrate_method: Literal["minmax", "entropy", "percentile"] = Field(
        "minmax", description="Static calibration method for the Q/DQ model."
    )
    percentile: float = Field(
        99.999, gt=90.0, le=100.0, description="percentile calibration: the |activation| percentile kept in range."
    )
    histogram_bins: int = Field(
        2048, ge=128, description="entropy/percentile calibration: histogram bins per tensor (entropy uses >= 128)."
    )
    op_types: list[QuantOpType] = Field(
        default_factory=lambda: ["MatMul", "Gemm"],
        min_length=1,
        description="ONNX op types the Q/DQ model quantizes; ['all'] quantizes every op ONNX Runtime can "
        "(costs ~15% perplexity on GPT-2 shapes).",
    )
    per_channel: bool = Field(True, description="Per-channel weight scales in the Q/DQ model.")
    share_tied_embedding: bool = Field(
        True,
        description="Dynamic INT8: a token embedding tied to the LM head looks up rows of the head's int8 table "
        "instead of keeping its own FP32 copy (GPT-2 shapes: about 0.25x the FP32 size instead of 0.55x).",
    )
    exclude_unsafe_nodes: bool = Field(
        True,
        description="Leave unquantized every node touching a tensor whose calibrated range is non-finite or beyond "
        "unsafe_range_limit (e.g. the attention-mask fill value), which would ruin its int8 scale.",
    )
    unsafe_range_limit: float = Field(
        1e6, gt=0.0, description="A calibrated |activation| above this marks the tensor unsafe to quantize."
    )
    max_perplexity_delta: float = Field(
        0.02,
        ge=0.0,
        description="Accuracy gate: an INT8 model whose held-out perplexity exceeds the FP32 model's (same "
        "runtime) by more than this fraction is marked rejected.",
    )
    gate_context: int = Field(128, gt=1, description="Accuracy gate: window length (clamped to the model's positions).")
    gate_eval_tokens: int = Field(
        16_384, gt=1, description="Accuracy gate: held-out (val split) tokens scored per model."
    )


class TensorRTConfig(StrictModel):
    """The ``build_tensorrt`` stage (needs a GPU and the tensorrt package)."""

    precision: Literal["int8", "fp16", "fp32"] = Field("int8", description="Engine precision.")
    graph: Literal["auto", "no_past", "with_past"] = Field(
        "auto",
        description="Graph to build: no_past is decoder_model.onnx (no cache), with_past is model.onnx (KV cache in "
        "and out); auto takes the cache graph when the directory has one.",
    )
    builder: Literal["python", "trtexec"] = Field(
        "python", description="Build with the TensorRT Python API or by running the trtexec command line tool."
    )
    trtexec: str = Field("trtexec", min_length=1, description="trtexec executable (builder: trtexec).")
    min_batch: int = Field(1, gt=0, description="Optimization profile: minimum batch.")
    opt_batch: int = Field(4, gt=0, description="Optimization profile: optimal batch.")
    max_batch: int = Field(8, gt=0, description="Optimization profile: maximum batch.")
    min_seq: int = Field(1, gt=0, description="Optimization profile: minimum new tokens per call.")
    opt_seq: int = Field(64, gt=0, description="Optimization profile: optimal new tokens per call.")
    max_seq: int = Field(128, gt=0, description="Optimization profile: maximum new tokens per call.")
    min_past: int = Field(0, ge=0, description="Optimization profile (cache graph): minimum cached tokens.")
    opt_past: int = Field(64, ge=0, description="Optimization profile (cache graph): optimal cached tokens.")
    max_past: int = Field(128, ge=0, description="Optimization profile (cache graph): maximum cached tokens.")
    workspace_gib: float = Field(4.0, gt=0.0, description="Builder workspace limit in GiB.")
    timing_cache: str | None = Field(
        None,
        description="Timing-cache file read before and rewritten after each build, so later builds on the same GPU "
        "and TensorRT version reuse kernel timings; null disables it.",
    )

    @model_validator(mode="after")
    def _ordered_profiles(self) -> TensorRTConfig:
        if not self.min_batch <= self.opt_batch <= self.max_batch:
            raise ValueError("profile batch sizes must satisfy min_batch <= opt_batch <= max_batch")
        if not self.min_seq <= self.opt_seq <= self.max_seq:
            raise ValueError("profile sequence lengths must satisfy min_seq <= opt_seq <= max_seq")
        if not self.min_past <= self.opt_past <= self.max_past:
            raise ValueError("profile past lengths must satisfy min_past <= opt_past <= max_past")
        return self
