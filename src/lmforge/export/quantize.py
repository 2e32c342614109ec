"""The ``quantize_int8`` stage: an FP32 ONNX model directory to two INT8 model directories.

* dynamic INT8 (``quantize_dynamic``: int8 weights, activations quantized at run time) for CPU serving;
* static Q/DQ INT8 (``quantize_static`` with calibration on training tokens, symmetric int8 activations
  and weights, as TensorRT requires) for the ``build_tensorrt`` stage.

Both outputs follow the ONNX model directory contract of :mod:`lmforge.export.onnx_export`.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)
from onnxruntime.quantization.shape_inference import quant_pre_process

from lmforge.artifacts import input_record, staged_output, write_manifest
from lmforge.config import QuantizeConfig
from lmforge.data.shards import TokenShards
from lmforge.data.tokenizer import TOKENIZER_FILE, tokenizer_fingerprint
from lmforge.errors import InputDataError, LmforgeError
from lmforge.export.onnx_export import EXTERNAL_DATA_BYTES, copy_model_files
from lmforge.export.ort import MODEL_FILE, OrtCausalLM, model_size_bytes, resolve_model_file
from lmforge.results import StageResult

log = logging.getLogger("lmforge.export")

CALIBRATION_METHODS = {
    "minmax": CalibrationMethod.MinMax,
    "entropy": CalibrationMethod.Entropy,
    "percentile": CalibrationMethod.Percentile,
}
CALIBRATION_BATCH = 8


def calibration_windows(tokens: np.ndarray, count: int, seq_len: int) -> np.ndarray:
    """``count`` windows of ``seq_len`` tokens at evenly spaced offsets (deterministic), int64."""
    if len(tokens) < seq_len:
        raise InputDataError(f"train split has {len(tokens)} tokens, fewer than calibration_seq_len ({seq_len})")
    starts = np.linspace(0, len(tokens) - seq_len, num=count).astype(np.int64)
    return np.stack([np.asarray(tokens[s : s + seq_len], dtype=np.int64) for s in starts])


class TokenWindowReader(CalibrationDataReader):
    """Feed calibration windows to ONNX Runtime in batches of ``batch_size`` sequences."""

    def __init__(self, windows: np.ndarray, batch_size: int = CALIBRATION_BATCH) -> None:
        self.windows = windows
        self.batch_size = batch_size
        self._batches = self._iterate()

    def _iterate(self) -> Iterator[dict[str, np.ndarray]]:
        for i in range(0, len(self.windows), self.batch_size):
            ids = self.windows[i : i + self.batch_size]
            yield {"input_ids": ids, "attention_mask": np.ones_like(ids)}

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._batches, None)

    def rewind(self) -> None:
        self._batches = self._iterate()


def check_tokenizer_match(onnx_dir: Path, shards: TokenShards) -> str:
    """Return the tokenizer fingerprint; raise unless the shards were written with the same tokenizer."""
    if not (onnx_dir / TOKENIZER_FILE).is_file():
        raise InputDataError(f"{onnx_dir}: no {TOKENIZER_FILE}; cannot check the calibration tokens")
    expected = tokenizer_fingerprint(onnx_dir)
    if shards.tokenizer_sha256 != expected:
        raise InputDataError(
            f"token shards {shards.root} were written by tokenizer {shards.tokenizer_sha256[:12]}, "
            f"but {onnx_dir} uses tokenizer {expected[:12]}; calibrate with shards of the model's tokenizer"
        )
    return expected


def _preprocess(src: Path, dst: Path, external: bool) -> bool:
    """Shape inference + graph cleanup recommended before quantization; ``False`` when it failed."""
    try:
        quant_pre_process(str(src), str(dst), save_as_external_data=external, all_tensors_to_one_file=True)
        return True
    except Exception as exc:  # symbolic shape inference fails on some graphs; quantize the original then
        log.warning("quant_pre_process failed (%s: %s); quantizing the unprocessed model", type(exc).__name__, exc)
        return False


def _verify(model_dir: Path, sample: np.ndarray, reference: np.ndarray) -> float:
    """Load a quantized directory, check logits are finite and shaped; return max |diff| vs FP32."""
    logits = OrtCausalLM(model_dir).logits(sample)
    if logits.shape != reference.shape or not np.isfinite(logits).all():
        raise LmforgeError(f"{model_dir}: quantized model produced non-finite or misshaped logits {logits.shape}")
    return float(np.max(np.abs(logits - reference)))


def run(
    cfg: QuantizeConfig,
    onnx_dir: str | Path,
    shards_dir: str | Path,
    dynamic_dir: str | Path,
    qdq_dir: str | Path,
) -> StageResult:
    """Write a dynamic-INT8 model to ``dynamic_dir`` and a calibrated Q/DQ INT8 model to ``qdq_dir``."""
    start = time.perf_counter()
    onnx_dir = Path(onnx_dir)
    fp32_file = resolve_model_file(onnx_dir)
    source = input_record(onnx_dir)
    shards = TokenShards.open(shards_dir)
    check_tokenizer_match(onnx_dir, shards)
    windows = calibration_windows(shards.tokens("train"), cfg.calibration_sequences, cfg.calibration_seq_len)
    fp32_bytes = model_size_bytes(fp32_file)
    external = fp32_bytes > EXTERNAL_DATA_BYTES
    sample = windows[: min(len(windows), 2)]
    reference = OrtCausalLM(fp32_file).logits(sample)
    inputs = {"onnx_model": source, "shards": input_record(shards.root)}

    with (
        tempfile.TemporaryDirectory(prefix="lmforge-quant-") as tmp,
        staged_output(dynamic_dir) as dyn_out,
        staged_output(qdq_dir) as qdq_out,
    ):
        prepared = Path(tmp) / MODEL_FILE
        preprocessed = _preprocess(fp32_file, prepared, external)
        src = prepared if preprocessed else fp32_file

        quantize_dynamic(
            str(src),
            str(dyn_out / MODEL_FILE),
            op_types_to_quantize=["MatMul", "Gemm"],
            weight_type=QuantType.QInt8,
            use_external_data_format=external,
        )
        quantize_static(
            str(src),
            str(qdq_out / MODEL_FILE),
            TokenWindowReader(windows),
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=list(cfg.op_types),
            per_channel=cfg.per_channel,
            activation_type=QuantType.QInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CALIBRATION_METHODS[cfg.calibrate_method],
            use_external_data_format=external,
            # TensorRT only accepts symmetric (zero-point 0) int8 scales.
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
        )
        dynamic_diff = _verify(dyn_out, sample, reference)
        qdq_diff = _verify(qdq_out, sample, reference)
        metrics = {
            "fp32_size_mb": fp32_bytes / 1e6,
            "dynamic_size_mb": model_size_bytes(dyn_out / MODEL_FILE) / 1e6,
            "qdq_size_mb": model_size_bytes(qdq_out / MODEL_FILE) / 1e6,
            "calibration_sequences": float(len(windows)),
            "dynamic_max_abs_diff": dynamic_diff,
            "qdq_max_abs_diff": qdq_diff,
            "quantize_seconds": time.perf_counter() - start,
        }
        common: dict[str, Any] = {"preprocessed": preprocessed, "weight_type": "int8"}
        dynamic_facts = {"quantization": "dynamic-int8", "op_types": ["MatMul", "Gemm"], "per_channel": False}
        qdq_facts = {
            "quantization": "qdq-int8",
            "op_types": list(cfg.op_types),
            "per_channel": cfg.per_channel,
            "symmetric": True,
            "activation_type": "int8",
            "calibrate_method": cfg.calibrate_method,
            "calibration_sequences": len(windows),
            "calibration_seq_len": cfg.calibration_seq_len,
        }
        for out, facts in ((dyn_out, dynamic_facts), (qdq_out, qdq_facts)):
            copy_model_files(onnx_dir, out)
            write_manifest(
                out, "onnx-model", inputs=inputs, config=cfg.model_dump(), metrics=metrics, extra={**common, **facts}
            )
    log.info(
        "quantized %s: fp32 %.2f MB, dynamic %.2f MB, qdq %.2f MB (%d calibration sequences, %s)",
        onnx_dir,
        metrics["fp32_size_mb"],
        metrics["dynamic_size_mb"],
        metrics["qdq_size_mb"],
        len(windows),
        cfg.calibrate_method,
    )
    return StageResult(
        metrics=metrics,
        summary={"dynamic_dir": str(dynamic_dir), "qdq_dir": str(qdq_dir), "preprocessed": preprocessed},
    )
