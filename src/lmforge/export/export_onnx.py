"""The ``export_onnx`` stage: a Hugging Face causal LM to an ONNX model directory, checked for parity.

Output directory (the ONNX model contract other stages rely on), in the layout optimum's ``ORTModelForCausalLM``
loads: ``ORTModelForCausalLM.from_pretrained(DIR)`` takes ``model.onnx`` and generates with its KV cache
(tests/integration/test_consumers_transformers4.py).

* ``model.onnx`` — the decoder with a KV cache, for generation. Inputs ``input_ids`` and ``position_ids`` (int64
  ``[batch, seq]``), ``attention_mask`` (int64 ``[batch, past + seq]``: the mask of the cached and the new
  tokens) and per layer ``i`` ``past_key_values.{i}.key`` / ``past_key_values.{i}.value`` (float32
  ``[batch, kv_heads, past, head_dim]``); outputs ``logits`` and ``present.{i}.key`` /
  ``present.{i}.value`` (``[batch, kv_heads, past + seq, head_dim]``). Batch, sequence and past length are
  dynamic and the past may be empty (``past = 0``), so the same graph does the prefill and every decode
  step. Written unless ``ExportConfig.with_past`` is false.
* ``decoder_model.onnx`` — the decoder without a KV cache. Inputs ``input_ids``, ``attention_mask`` and
  ``position_ids`` (int64 ``[batch, seq]``), output ``logits`` (float32 ``[batch, seq, vocab]``); batch and
  sequence are dynamic. Scoring (perplexity, latency) uses this graph. The name is optimum's for a decoder
  without a cache: optimum loads it only when asked by ``file_name`` or when the directory has no ``model.onnx``.
* external data (``<graph>.onnx.data``) when the weights exceed 2 GB; the tokenizer and config files
  copied from the source model; ``manifest.json``.

The inputs are the ones optimum's exporter gives GPT-2 and Llama decoders (``TextDecoderWithPositionIdsOnnxConfig``
in ``optimum/exporters/onnx/config.py``), so optimum feeds the positions it derives itself. lmforge's runtime
(:mod:`lmforge.onnx_runtime`) derives them from the attention mask as transformers' ``generate`` does
(``cumsum(mask) - 1``, 0 on padding, the last ``seq`` of them with a past), so a left-padded row gets the same
logits as the unpadded sequence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from lmforge.artifacts import (
    input_record,
    staged_output,
    write_manifest,
)
from lmforge.config import ExportConfig
from lmforge.errors import LmforgeError
from lmforge.model.build import load_causal_lm
from lmforge.onnx_runtime import (
    EXTERNAL_DATA_BYTES,
    NO_PAST_FILE,
    POSITION_IDS,
    WITH_PAST_FILE,
    OrtCausalLM,
    OrtDecoderWithPast,
    copy_model_files,
    model_size_bytes,
    past_input_names,
    positions_from_mask,
    present_output_names,
)
from lmforge.results import StageResult

log = logging.getLogger("lmforge.export")

INPUT_NAMES = ("input_ids", "attention_mask", POSITION_IDS)
OUTPUT_NAME = "logits"
# Files carried from the model directory so an ONNX directory can be tokenized and described alone.
# Protobuf cannot hold more than 2 GiB; leave headroom for the graph itself.
PARITY_MAX_SEQ = 128


class ParityError(LmforgeError):
    """The exported ONNX model does not reproduce the PyTorch model's logits."""


def _cache_of(output: Any) -> Any:
    """The KV cache of a model output (``cache`` in transformers 5, ``past_key_values`` before)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


class LogitsOnly(torch.nn.Module):
    """Wrap a causal LM so that it takes ``(input_ids, attention_mask, position_ids)`` and returns only the logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).logits


class DecoderWithPast(torch.nn.Module):
    """Wrap a causal LM as ``(input_ids, attention_mask, position_ids, [past k, v per layer]) -> (logits, *present)``.

    The cache travels as flat tensors (``[batch, kv_heads, past, head_dim]``, key then value per layer) so
    the exported graph has one named input and output per tensor.
    """

    def __init__(self, model: torch.nn.Module, n_layers: int) -> None:
        super().__init__()
        self.model = model
        self.n_layers = n_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past: list[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(self.n_layers)])
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache, use_cache=True
        )
        present: list[torch.Tensor] = []
        for layer in _cache_of(out).layers:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


@dataclass(frozen=True)
class CacheLayout:
    """Shape of one layer's cached keys (and values): ``[batch, kv_heads, past, head_dim]``."""

    layers: int
    kv_heads: int
    head_dim: int

    def empty(self, batch: int, past: int = 0) -> list[torch.Tensor]:
        """Zero past tensors (key, value per layer)."""
        return [torch.zeros(batch, self.kv_heads, past, self.head_dim) for _ in range(2 * self.layers)]


def cache_layout(model: torch.nn.Module) -> CacheLayout:
    """Read the KV-cache layout off one forward pass (works for any architecture ``DynamicCache`` serves)."""
    with torch.no_grad():
        out = model(input_ids=torch.zeros(1, 2, dtype=torch.long), use_cache=True)
    layers = _cache_of(out).layers
    _, heads, _, head_dim = layers[0].keys.shape
    return CacheLayout(layers=len(layers), kv_heads=int(heads), head_dim=int(head_dim))


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


@dataclass(frozen=True)
class GraphSpec:
    """Names and dynamic axes of one exported graph."""

    input_names: list[str]
    output_names: list[str]
    dynamic_shapes: tuple[Any, ...]
    """Per ``forward`` argument, in its structure (dynamo exporter)."""
    dynamic_axes: dict[str, dict[int, str]]
    """Per flat input and output name (TorchScript exporter)."""


def no_cache_spec() -> GraphSpec:
    """``decoder_model.onnx``: ``input_ids``/``attention_mask``/``position_ids`` ``[batch, seq]`` -> ``logits``."""
    axes = {0: "batch", 1: "seq"}
    return GraphSpec(
        input_names=list(INPUT_NAMES),
        output_names=[OUTPUT_NAME],
        dynamic_shapes=(axes, axes, axes),
        dynamic_axes={**{name: axes for name in INPUT_NAMES}, OUTPUT_NAME: axes},
    )


def with_past_spec(layers: int) -> GraphSpec:
    """``model.onnx``: new tokens, the whole mask and the past -> logits and the present."""
    past_names, present_names = past_input_names(layers), present_output_names(layers)
    past_axes = {0: "batch", 2: "past"}
    return GraphSpec(
        input_names=[*INPUT_NAMES, *past_names],
        output_names=[OUTPUT_NAME, *present_names],
        dynamic_shapes=(
            {0: "batch", 1: "seq"},
            {0: "batch", 1: "past_seq"},
            {0: "batch", 1: "seq"},
            [past_axes] * len(past_names),
        ),
        dynamic_axes={
            "input_ids": {0: "batch", 1: "seq"},
            "attention_mask": {0: "batch", 1: "past_seq"},
            POSITION_IDS: {0: "batch", 1: "seq"},
            OUTPUT_NAME: {0: "batch", 1: "seq"},
            **{name: past_axes for name in past_names},
            **{name: {0: "batch", 2: "past_seq"} for name in present_names},
        },
    )


def _export(wrapper: torch.nn.Module, example: tuple[Any, ...], path: Path, opset: int, spec: GraphSpec) -> str:
    """Write ``wrapper`` to ``path`` with the dynamo exporter, or the TorchScript one if dynamo fails."""
    n_bytes = sum(p.numel() * p.element_size() for p in wrapper.parameters())
    external = n_bytes > EXTERNAL_DATA_BYTES
    try:
        program = torch.onnx.export(
            wrapper,
            example,
            dynamo=True,
            opset_version=opset,
            input_names=spec.input_names,
            output_names=spec.output_names,
            dynamic_shapes=spec.dynamic_shapes,
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
        input_names=spec.input_names,
        output_names=spec.output_names,
        dynamic_axes=spec.dynamic_axes,
    )
    if external:
        import onnx

        model = onnx.load(str(path))
        onnx.save_model(model, str(path), save_as_external_data=True, location=f"{path.name}.data")
    return "torchscript"


def check_parity(
    wrapper: torch.nn.Module, session: OrtCausalLM, cases: list[tuple[np.ndarray, np.ndarray]]
) -> list[dict[str, Any]]:
    """Max |logit| difference between PyTorch and ONNX Runtime per case, over positions where mask == 1."""
    results = []
    for ids, mask in cases:
        with torch.no_grad():
            positions = torch.from_numpy(positions_from_mask(mask, ids.shape[1]))
            expected = wrapper(torch.from_numpy(ids), torch.from_numpy(mask), positions).float().numpy()
        actual = session.logits(ids, mask)
        if actual.shape != expected.shape:
            raise ParityError(f"ONNX logits shape {actual.shape} differs from PyTorch {expected.shape}")
        keep = mask.astype(bool)
        diff = float(np.max(np.abs(actual[keep] - expected[keep])))
        if not np.isfinite(diff):
            raise ParityError(f"non-finite ONNX logits for input shape {ids.shape}")
        results.append({"shape": list(ids.shape), "padded": bool((mask == 0).any()), "max_abs_diff": diff})
    return results


def with_past_cases(vocab_size: int, max_positions: int, seed: int = 1) -> list[tuple[np.ndarray, int]]:
    """Chained ``(new input_ids, past length)`` steps on a left-padded batch of 2: prefill, one token, a chunk."""
    rng = np.random.default_rng(seed)
    prefill = max(2, min(12, max_positions - 5))
    steps = [(2, prefill, 0), (2, 1, prefill), (2, 4, prefill + 1)]
    return [(rng.integers(0, vocab_size, size=(b, s), dtype=np.int64), past) for b, s, past in steps]


def check_parity_with_past(
    wrapper: DecoderWithPast, session: OrtDecoderWithPast, steps: Sequence[tuple[np.ndarray, int]], pad: int = 3
) -> list[dict[str, Any]]:
    """Max |difference| of logits and present tensors between PyTorch and ONNX Runtime per step.

    The steps run chained on one batch whose second row is left-padded by ``pad`` tokens; both runtimes get
    PyTorch's present of the previous step as their past, so each step is compared on identical inputs.
    """
    results = []
    past = session.empty_past(int(steps[0][0].shape[0]))
    mask = np.zeros((steps[0][0].shape[0], 0), dtype=np.int64)
    for ids, past_len in steps:
        if past[0].shape[2] != past_len:
            raise ValueError(f"step expects past length {past_len}, the chain holds {past[0].shape[2]}")
        new_mask = np.ones_like(ids)
        if past_len == 0:
            new_mask[1:, : min(pad, ids.shape[1] - 1)] = 0
        mask = np.concatenate([mask, new_mask], axis=1)
        with torch.no_grad():
            positions = torch.from_numpy(positions_from_mask(mask, ids.shape[1]))
            torch_past = [torch.from_numpy(p) for p in past]
            expected = [
                t.float().numpy() for t in wrapper(torch.from_numpy(ids), torch.from_numpy(mask), positions, torch_past)
            ]
        logits, present = session.step(ids, mask, past)
        keep = new_mask.astype(bool)
        logit_diff = float(np.max(np.abs(logits[keep] - expected[0][keep])))
        kv_keep = mask.astype(bool)  # cached tensors of padded positions are never attended to
        kv_diff = max(
            float(np.max(np.abs(np.moveaxis(a, 2, 1)[kv_keep] - np.moveaxis(e, 2, 1)[kv_keep])))
            for a, e in zip(present, expected[1:], strict=True)
        )
        if not (np.isfinite(logit_diff) and np.isfinite(kv_diff)):
            raise ParityError(f"non-finite ONNX output with past for input shape {ids.shape}, past {past_len}")
        results.append(
            {"shape": list(ids.shape), "past": past_len, "max_abs_diff": logit_diff, "present_max_abs_diff": kv_diff}
        )
        past = expected[1:]
    return results


def _raise_if_over(name: str, results: list[dict[str, Any]], tolerance: float, what: str) -> float:
    worst = max(max(r["max_abs_diff"], r.get("present_max_abs_diff", 0.0)) for r in results)
    if worst > tolerance:
        raise ParityError(
            f"ONNX export of {name}: max |difference| {worst:.3g} exceeds parity_tolerance {tolerance:g} "
            f"({what}; per case: {results})"
        )
    return worst


def no_past_example(max_positions: int) -> tuple[torch.Tensor, ...]:
    """Example inputs that trace the no-cache graph: ids, mask and positions of a batch of 2 sequences."""
    # Batch 2 and sequence 8: sizes 0 and 1 would be specialized as constants by torch.export.
    shape = (2, min(8, max_positions))
    return (
        torch.zeros(shape, dtype=torch.long),
        torch.ones(shape, dtype=torch.long),
        torch.arange(shape[1]).expand(shape),
    )


def with_past_example(layout: CacheLayout) -> tuple[Any, ...]:
    """Example inputs that trace the cache graph: 3 new tokens after a past of 4, batch 2."""
    # Past length 4 and 3 new tokens: no dimension of size 0 or 1 for torch.export to specialize.
    return (
        torch.zeros((2, 3), dtype=torch.long),
        torch.ones((2, 7), dtype=torch.long),
        torch.arange(4, 7).expand(2, 3),
        layout.empty(2, past=4),
    )


def export_no_past(
    lm: torch.nn.Module, model: Path, path: Path, cfg: ExportConfig
) -> tuple[str, list[dict[str, Any]], float]:
    """Export the no-cache graph of ``lm`` to ``path`` and check it against PyTorch.

    Returns:
        The exporter used, the parity per case and the worst difference (within ``cfg.parity_tolerance``).
    """
    wrapper = LogitsOnly(lm).eval()
    max_positions = _max_positions(lm)
    with torch.no_grad():
        exporter = _export(wrapper, no_past_example(max_positions), path, cfg.opset, no_cache_spec())
    session = OrtCausalLM(path)  # runs onnx.checker on the file
    parity = check_parity(wrapper, session, parity_cases(int(lm.config.vocab_size), max_positions))
    worst = _raise_if_over(f"{model} ({exporter} exporter)", parity, cfg.parity_tolerance, NO_PAST_FILE)
    return exporter, parity, worst


def export_with_past(
    lm: torch.nn.Module, model: Path, path: Path, cfg: ExportConfig
) -> tuple[dict[str, float], dict[str, Any]]:
    """Export the cache graph of ``lm`` to ``path`` and check it against PyTorch, step by step.

    Returns:
        Its metrics (worst parity, size) and its record for the manifest.
    """
    layout = cache_layout(lm)
    decoder = DecoderWithPast(lm, layout.layers).eval()
    with torch.no_grad():
        exporter = _export(decoder, with_past_example(layout), path, cfg.opset, with_past_spec(layout.layers))
    steps = with_past_cases(int(lm.config.vocab_size), _max_positions(lm))
    parity = check_parity_with_past(decoder, OrtDecoderWithPast(path), steps)
    worst = _raise_if_over(f"{model} ({exporter} exporter)", parity, cfg.parity_tolerance, WITH_PAST_FILE)
    metrics = {"with_past_parity_max_abs_diff": worst, "with_past_size_mb": model_size_bytes(path) / 1e6}
    record = {
        "file": WITH_PAST_FILE,
        "exporter": exporter,
        "layers": layout.layers,
        "kv_heads": layout.kv_heads,
        "head_dim": layout.head_dim,
        "parity": parity,
    }
    return metrics, record


def _max_positions(lm: torch.nn.Module) -> int:
    """The model's maximum positions, else :data:`PARITY_MAX_SEQ`."""
    return int(getattr(lm.config, "max_position_embeddings", None) or PARITY_MAX_SEQ)


def run(cfg: ExportConfig, *, model: str | Path, onnx_model: str | Path) -> StageResult:
    """Export ``model`` to an ONNX model directory at ``onnx_model`` and verify it against PyTorch."""
    start = time.perf_counter()
    model = Path(model)
    lm = load_causal_lm(model, dtype=torch.float32)
    source = input_record(model)

    with staged_output(onnx_model) as out:
        copy_model_files(model, out)
        exporter, parity, worst = export_no_past(lm, model, out / NO_PAST_FILE, cfg)
        metrics = {"parity_max_abs_diff": worst, "onnx_size_mb": model_size_bytes(out / NO_PAST_FILE) / 1e6}
        extra: dict[str, Any] = {"exporter": exporter, "opset": cfg.opset, "quantization": "none", "parity": parity}
        if cfg.with_past:
            past_metrics, extra["with_past"] = export_with_past(lm, model, out / WITH_PAST_FILE, cfg)
            metrics.update(past_metrics)
        metrics["export_seconds"] = time.perf_counter() - start
        write_manifest(
            out, "onnx-model", inputs={"model": source}, config=cfg.model_dump(), metrics=metrics, extra=extra
        )
    log.info(
        "exported %s -> %s (%s exporter, opset %d, %.2f MB, parity %.2e%s)",
        model,
        onnx_model,
        exporter,
        cfg.opset,
        metrics["onnx_size_mb"],
        worst,
        f", with past: parity {metrics['with_past_parity_max_abs_diff']:.2e}" if cfg.with_past else "",
    )
    summary: dict[str, Any] = {
        "output_dir": str(onnx_model),
        "exporter": exporter,
        "opset": cfg.opset,
        "parity": parity,
    }
    if cfg.with_past:
        summary["with_past"] = extra["with_past"]
    return StageResult(metrics=metrics, summary=summary)
