"""Run an exported causal LM with ONNX Runtime on CPU.

The model directory follows the lmforge ONNX contract: ``model.onnx`` (plus external data when the
weights exceed 2 GB) with inputs ``input_ids`` / ``attention_mask`` (int64 ``[batch, seq]``) and
output ``logits`` (float32 ``[batch, seq, vocab]``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from lmforge.errors import InputDataError

log = logging.getLogger("lmforge.export")

MODEL_FILE = "model.onnx"


def resolve_model_file(model_dir_or_file: str | Path) -> Path:
    """``model.onnx`` inside a directory, or the file itself; raise if it does not exist."""
    path = Path(model_dir_or_file)
    file = path / MODEL_FILE if path.is_dir() else path
    if not file.is_file():
        raise InputDataError(f"ONNX model not found: {file}")
    return file


def external_data_files(model_file: str | Path) -> list[Path]:
    """Files holding the model's external tensor data (empty when every weight is inline)."""
    model_file = Path(model_file)
    model = onnx.load(str(model_file), load_external_data=False)
    locations: set[str] = set()
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        for tensor in graph.initializer:
            if uses_external_data(tensor):
                locations.add(ExternalDataInfo(tensor).location)
        for node in graph.node:
            graphs.extend(attr.g for attr in node.attribute if attr.HasField("g"))
            graphs.extend(g for attr in node.attribute for g in attr.graphs)
    return [model_file.parent / loc for loc in sorted(locations)]


def model_size_bytes(model_file: str | Path) -> int:
    """Bytes on disk of the model file plus its external data files."""
    model_file = Path(model_file)
    return model_file.stat().st_size + sum(f.stat().st_size for f in external_data_files(model_file) if f.is_file())


class OrtCausalLM:
    """A causal LM exported to ONNX, run by an ONNX Runtime CPU session.

    Args:
        model_dir_or_file: an ONNX model directory (holding ``model.onnx``) or the ``.onnx`` file.
        threads: intra-op threads; ``None`` lets ONNX Runtime choose.
    """

    def __init__(self, model_dir_or_file: str | Path, *, threads: int | None = None) -> None:
        self.path = resolve_model_file(model_dir_or_file)
        try:
            # Checking by path also validates external data and models over 2 GB.
            onnx.checker.check_model(str(self.path))
        except onnx.checker.ValidationError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InputDataError(f"{self.path}: not a valid ONNX model ({first})") from exc
        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(self.path), options, providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]
        if "input_ids" not in self.input_names:
            raise InputDataError(f"{self.path}: graph has no 'input_ids' input (inputs: {self.input_names})")
        self._size_bytes = model_size_bytes(self.path)

    @property
    def size_bytes(self) -> int:
        """Bytes on disk: the model file plus its external data."""
        return self._size_bytes

    def logits(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
        """Float32 logits ``[batch, seq, vocab]`` for token ids ``[batch, seq]`` (mask defaults to ones)."""
        input_ids = np.asarray(input_ids, dtype=np.int64)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be 2-D [batch, seq], got shape {input_ids.shape}")
        if attention_mask is None:
            attention_mask = np.ones_like(input_ids)
        attention_mask = np.asarray(attention_mask, dtype=np.int64)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {attention_mask.shape} differs from input_ids shape {input_ids.shape}"
            )
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask}
        (logits,) = self.session.run(["logits"], {k: v for k, v in feeds.items() if k in self.input_names})
        return logits
