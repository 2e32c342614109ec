"""The ``export_onnx`` stage: a Hugging Face causal LM to an ONNX model directory, checked for parity.

Output directory (the ONNX model contract other stages rely on): ``model.onnx`` (plus external data
when the weights exceed 2 GB), the tokenizer and config files copied from the source model, and
``manifest.json``. Graph inputs ``input_ids`` and ``attention_mask`` (int64 ``[batch, seq]``), output
``logits`` (float32 ``[batch, seq, vocab]``); batch and sequence are dynamic.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.artifacts import (
    input_record,
    staged_output,
    write_manifest,
)
from lmforge.config import ExportConfig
from lmforge.errors import InputDataError, LmforgeError
from lmforge.export.ort import MODEL_FILE, OrtCausalLM, model_size_bytes
from lmforge.model.build import load_causal_lm
from lmforge.results import StageResult

log = logging.getLogger("lmforge.export")

INPUT_NAMES = ("input_ids", "attention_mask")
OUTPUT_NAME = "logits"
# Files carried from the model directory so an ONNX directory can be tokenized and described alone.
CARRIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
# Protobuf cannot hold more than 2 GiB; leave headroom for the graph itself.
EXTERNAL_DATA_BYTES = 1_800_000_000
PARITY_MAX_SEQ = 128


class ParityError(LmforgeError):
    """The exported ONNX model does not reproduce the PyTorch model's logits."""


class LogitsOnly(torch.nn.Module):
    """Wrap a causal LM so that it takes ``(input_ids, attention_mask)`` and returns only the logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def copy_model_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer and config files of ``src`` into ``dst``; a source needs a tokenizer."""
    src, dst = Path(src), Path(dst)
    if not (src / "tokenizer.json").is_file():
        raise InputDataError(f"{src}: no tokenizer.json; an ONNX model directory must carry its tokenizer")
    copied = []
    for name in CARRIED_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def parity_cases(vocab_size: int, max_positions: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Deterministic ``(input_ids, attention_mask)`` cases: one token, one sequence, a left-padded pair."""
    rng = np.random.default_rng(seed)
    longest = min(max_positions, PARITY_MAX_SEQ)
    cases = []
    for batch, seq, pad in ((1, 1, 0), (1, min(17, longest), 0), (2, longest, min(5, longest - 1))):
        ids = rng.integers(0, vocab_size, size=(batch, seq), dtype=np.int64)
        mask = np.ones_like(ids)
        mask[1:, :pad] = 0  # left padding on every row after the first
        cases.append((ids, mask))
    return cases


def _export(wrapper: torch.nn.Module, example: tuple[torch.Tensor, ...], path: Path, opset: int) -> str:
    """Write ``wrapper`` to ``path`` with the dynamo exporter, or the TorchScript one if dynamo fails."""
    n_bytes = sum(p.numel() * p.element_size() for p in wrapper.parameters())
    external = n_bytes > EXTERNAL_DATA_BYTES
    axes = {0: "batch", 1: "seq"}
    try:
        program = torch.onnx.export(
            wrapper,
            example,
            dynamo=True,
            opset_version=opset,
            input_names=list(INPUT_NAMES),
            output_names=[OUTPUT_NAME],
            dynamic_shapes={name: axes for name in INPUT_NAMES},
            verbose=False,
        )
        program.save(path, external_data=external)
        return "dynamo"
    except Exception as exc:  # the exporter raises many types; we fall back and record it
        log.warning("dynamo ONNX exporter failed (%s: %s); falling back to TorchScript", type(exc).__name__, exc)
        for leftover in path.parent.glob(f"{path.name}*"):
            leftover.unlink()
    torch.onnx.export(
        wrapper,
        example,
        str(path),
        dynamo=False,
        opset_version=opset,
        input_names=list(INPUT_NAMES),
        output_names=[OUTPUT_NAME],
        dynamic_axes={**{name: axes for name in INPUT_NAMES}, OUTPUT_NAME: axes},
    )
    return "torchscript"


def check_parity(
    wrapper: torch.nn.Module, session: OrtCausalLM, cases: list[tuple[np.ndarray, np.ndarray]]
) -> list[dict[str, Any]]:
    """Max |logit| difference between PyTorch and ONNX Runtime per case, over positions where mask == 1."""
    results = []
    for ids, mask in cases:
        with torch.no_grad():
            expected = wrapper(torch.from_numpy(ids), torch.from_numpy(mask)).float().numpy()
        actual = session.logits(ids, mask)
        if actual.shape != expected.shape:
            raise ParityError(f"ONNX logits shape {actual.shape} differs from PyTorch {expected.shape}")
        keep = mask.astype(bool)
        diff = float(np.max(np.abs(actual[keep] - expected[keep])))
        if not np.isfinite(diff):
            raise ParityError(f"non-finite ONNX logits for input shape {ids.shape}")
        results.append({"shape": list(ids.shape), "padded": bool((mask == 0).any()), "max_abs_diff": diff})
    return results


def run(cfg: ExportConfig, model_dir: str | Path, output_dir: str | Path) -> StageResult:
    """Export ``model_dir`` to an ONNX model directory at ``output_dir`` and verify it against PyTorch."""
    start = time.perf_counter()
    model_dir = Path(model_dir)
    model = load_causal_lm(model_dir, dtype=torch.float32)
    wrapper = LogitsOnly(model).eval()
    vocab_size = int(model.config.vocab_size)
    max_positions = int(getattr(model.config, "max_position_embeddings", None) or PARITY_MAX_SEQ)
    source = input_record(model_dir)

    with staged_output(output_dir) as out:
        copy_model_files(model_dir, out)
        path = out / MODEL_FILE
        # Batch 2 and sequence 8: sizes 0 and 1 would be specialized as constants by torch.export.
        shape = (2, min(8, max_positions))
        example = (torch.zeros(shape, dtype=torch.long), torch.ones(shape, dtype=torch.long))
        with torch.no_grad():
            exporter = _export(wrapper, example, path, cfg.opset)
        session = OrtCausalLM(path)  # runs onnx.checker on the file
        parity = check_parity(wrapper, session, parity_cases(vocab_size, max_positions))
        worst = max(p["max_abs_diff"] for p in parity)
        if worst > cfg.parity_tolerance:
            raise ParityError(
                f"ONNX export of {model_dir} ({exporter} exporter): max |logit| difference {worst:.3g} "
                f"exceeds parity_tolerance {cfg.parity_tolerance:g} (per case: {parity})"
            )
        size = model_size_bytes(path)
        metrics = {
            "parity_max_abs_diff": worst,
            "onnx_size_mb": size / 1e6,
            "export_seconds": time.perf_counter() - start,
        }
        write_manifest(
            out,
            "onnx-model",
            inputs={"model": source},
            config=cfg.model_dump(),
            metrics=metrics,
            extra={"exporter": exporter, "opset": cfg.opset, "quantization": "none", "parity": parity},
        )
    log.info(
        "exported %s -> %s (%s exporter, opset %d, %.2f MB, parity %.2e)",
        model_dir,
        output_dir,
        exporter,
        cfg.opset,
        metrics["onnx_size_mb"],
        worst,
    )
    return StageResult(
        metrics=metrics,
        summary={"output_dir": str(output_dir), "exporter": exporter, "opset": cfg.opset, "parity": parity},
    )
