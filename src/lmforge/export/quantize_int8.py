"""The ``quantize_int8`` stage: an FP32 ONNX model directory to two INT8 model directories, each gated.

* dynamic INT8 (``quantize_dynamic``: int8 weights of MatMul/Gemm, activations quantized at run time) for
  CPU serving with ONNX Runtime;
* static Q/DQ INT8 (symmetric int8 activations and per-channel weights, as TensorRT requires) for the
  ``build_tensorrt`` stage, calibrated on windows of the training tokens with MinMax, entropy or
  percentile. Before calibrating, a MinMax pass finds tensors whose range is non-finite or beyond
  ``unsafe_range_limit`` (the attention-mask fill value ``finfo.min`` is the usual one: it makes a scale
  useless and the histogram calibrators fail with "Too many bins"); the nodes touching them stay in float
  and the histogram calibrators skip them.

Both graphs of the directory are quantized (``decoder_model.onnx`` and, when present, the cache graph
``model.onnx``; the cache graph is calibrated with a real past: the first half of each window is prefilled by the FP32
decoder, the second half is the new tokens).

Accuracy gate: held-out perplexity (``val`` split, :func:`lmforge.metrics.perplexity.perplexity`) of each
INT8 ``decoder_model.onnx`` vs the FP32 ``decoder_model.onnx``, all in ONNX Runtime. An INT8 model whose relative
delta is above ``max_perplexity_delta`` is still written (pipelines need the output) but its ``manifest.json`` says
``accuracy_gate.accepted: false`` with the reason; ``evaluate`` then serves the next model in its preference
(:func:`lmforge.contracts.served_model`, e.g. FP32), and ``promote`` withholds it from the release.
"""

from __future__ import annotations

import html
import json
import logging
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)
from onnxruntime.quantization.calibrate import (
    EntropyCalibrater,
    MinMaxCalibrater,
    PercentileCalibrater,
    TensorsData,
    save_tensors_data,
)
from onnxruntime.quantization.shape_inference import quant_pre_process

from lmforge.artifacts import input_record, staged_output, write_manifest
from lmforge.config import QuantizeConfig
from lmforge.contracts import GATE_KEY, gate_decision, max_positions
from lmforge.data.tokenizer import TOKENIZER_FILE, tokenizer_fingerprint
from lmforge.errors import InputDataError, LmforgeError
from lmforge.export.tied_embedding import share_tied_embedding_file
from lmforge.formats.token_shards import TokenShards
from lmforge.metrics.perplexity import onnx_logits_fn, perplexity
from lmforge.onnx_runtime import (
    EXTERNAL_DATA_BYTES,
    NO_PAST_FILE,
    WITH_PAST_FILE,
    OrtCausalLM,
    OrtDecoderWithPast,
    copy_model_files,
    model_size_bytes,
    resolve_model_file,
    token_feeds,
)
from lmforge.results import StageResult

log = logging.getLogger("lmforge.export")

CALIBRATION_METHODS = {
    "minmax": CalibrationMethod.MinMax,
    "entropy": CalibrationMethod.Entropy,
    "percentile": CalibrationMethod.Percentile,
}
CALIBRATION_BATCH = 8
DYNAMIC_OP_TYPES = ("MatMul", "Gemm")
# ONNX Runtime's entropy calibrator searches thresholds over num_bins/2 candidates; 128 is its default.
ENTROPY_BINS = 128


def calibration_windows(tokens: np.ndarray, count: int, seq_len: int) -> np.ndarray:
    """``count`` windows of ``seq_len`` tokens at evenly spaced offsets (deterministic), int64."""
    if len(tokens) < seq_len:
        raise InputDataError(f"train split has {len(tokens)} tokens, fewer than calibration_seq_len ({seq_len})")
    starts = np.linspace(0, len(tokens) - seq_len, num=count).astype(np.int64)
    return np.stack([np.asarray(tokens[s : s + seq_len], dtype=np.int64) for s in starts])


def even_batch_size(count: int, at_most: int = CALIBRATION_BATCH) -> int:
    """The largest batch size <= ``at_most`` dividing ``count``: ONNX Runtime's histogram calibrators stack
    every batch's activations into one array and fail on a shorter last batch."""
    return next(size for size in range(min(at_most, count), 0, -1) if count % size == 0)


class TokenWindowReader(CalibrationDataReader):
    """Feed calibration windows to the no-cache graph in batches of ``batch_size`` sequences."""

    def __init__(self, windows: np.ndarray, batch_size: int = CALIBRATION_BATCH) -> None:
        self.windows = windows
        self.batch_size = batch_size
        self._batches = self._iterate()

    def _iterate(self) -> Iterator[dict[str, np.ndarray]]:
        for i in range(0, len(self.windows), self.batch_size):
            ids = self.windows[i : i + self.batch_size]
            yield token_feeds(ids, np.ones_like(ids))

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._batches, None)

    def rewind(self) -> None:
        self._batches = self._iterate()


class PastWindowReader(CalibrationDataReader):
    """Feed the cache graph: the first half of each window goes through the FP32 decoder as the past."""

    def __init__(self, windows: np.ndarray, fp32_decoder: OrtDecoderWithPast, batch_size: int = CALIBRATION_BATCH):
        self.windows = windows
        self.decoder = fp32_decoder
        self.batch_size = batch_size
        self._batches = self._iterate()

    def _iterate(self) -> Iterator[dict[str, np.ndarray]]:
        split = self.windows.shape[1] // 2
        for i in range(0, len(self.windows), self.batch_size):
            ids = self.windows[i : i + self.batch_size]
            head, tail = ids[:, :split], ids[:, split:]
            _, past = self.decoder.step(head, np.ones_like(head), self.decoder.empty_past(len(ids)))
            yield self.decoder.feeds(tail, np.ones_like(ids), past)

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
        for leftover in dst.parent.glob(f"{dst.name}*"):
            leftover.unlink()
        return False


def _calibrator(
    method: str,
    model_file: Path,
    op_types: Sequence[str] | None,
    augmented: Path,
    *,
    skip: set[str],
    cfg: QuantizeConfig,
    external: bool,
) -> MinMaxCalibrater:
    """ONNX Runtime's calibrator for ``method``, collecting every candidate tensor except ``skip``."""
    if method == "minmax":
        base: type = MinMaxCalibrater
        options: dict[str, Any] = {"symmetric": True}
    elif method == "entropy":
        base = EntropyCalibrater
        options = {"symmetric": True, "num_bins": ENTROPY_BINS, "num_quantized_bins": ENTROPY_BINS}
    else:
        base = PercentileCalibrater
        options = {"symmetric": True, "num_bins": cfg.histogram_bins, "percentile": cfg.percentile}

    class Filtered(base):  # type: ignore[misc, valid-type]
        def select_tensors_to_calibrate(self, model: onnx.ModelProto) -> tuple[set[str], dict[str, Any]]:
            tensors, value_infos = super().select_tensors_to_calibrate(model)
            return tensors - skip, value_infos

    calibrator = Filtered(
        str(model_file),
        op_types_to_calibrate=list(op_types) if op_types else None,
        augmented_model_path=str(augmented),
        use_external_data_format=external,
        **options,
    )
    calibrator.augment_graph()
    calibrator.create_inference_session()
    return calibrator


def unsafe_tensors(ranges: TensorsData, limit: float) -> set[str]:
    """Tensors whose calibrated range is non-finite or reaches beyond ``limit`` in magnitude."""
    unsafe = set()
    for name, data in ranges.data.items():
        low, high = (np.asarray(v, dtype=np.float64) for v in data.range_value)
        bounds = np.concatenate([low.ravel(), high.ravel()])
        if not np.isfinite(bounds).all() or np.abs(bounds).max() > limit:
            unsafe.add(name)
    return unsafe


def nodes_touching(model_file: Path, tensors: set[str], op_types: Sequence[str] | None) -> list[str]:
    """Names of the nodes (of ``op_types``, all when ``None``) that read or write any of ``tensors``."""
    graph = onnx.load(str(model_file), load_external_data=False).graph
    return [
        node.name
        for node in graph.node
        if (not op_types or node.op_type in op_types) and tensors.intersection([*node.input, *node.output])
    ]


def quantize_qdq(
    src: Path,
    dst: Path,
    reader: CalibrationDataReader,
    cfg: QuantizeConfig,
    *,
    external: bool,
    workdir: Path,
) -> dict[str, Any]:
    """Calibrate ``src`` on ``reader`` and write the symmetric int8 Q/DQ model ``dst``; return the facts."""
    op_types = None if "all" in cfg.op_types else list(cfg.op_types)
    workdir.mkdir(parents=True, exist_ok=True)
    minmax = _calibrator("minmax", src, op_types, workdir / "minmax.onnx", skip=set(), cfg=cfg, external=external)
    minmax.collect_data(reader)
    ranges = minmax.compute_data()
    del minmax
    unsafe = unsafe_tensors(ranges, cfg.unsafe_range_limit) if cfg.exclude_unsafe_nodes else set()
    excluded = nodes_touching(src, unsafe, op_types) if unsafe else []
    if excluded:
        log.info(
            "Q/DQ %s: %d node(s) stay float, they touch unsafe tensors %s", src.name, len(excluded), sorted(unsafe)
        )
    if cfg.calibrate_method != "minmax":
        reader.rewind()
        histogram = _calibrator(
            cfg.calibrate_method, src, op_types, workdir / "hist.onnx", skip=unsafe, cfg=cfg, external=external
        )
        histogram.collect_data(reader)
        ranges = histogram.compute_data()
        del histogram
    else:
        ranges = TensorsData(CalibrationMethod.MinMax, {k: v for k, v in ranges.data.items() if k not in unsafe})
    cache = workdir / "calibration.json"
    save_tensors_data(ranges, cache)
    quantize_static(
        str(src),
        str(dst),
        None,
        calibration_cache_path=str(cache),
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=op_types,
        nodes_to_exclude=excluded,
        per_channel=cfg.per_channel,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=CALIBRATION_METHODS[cfg.calibrate_method],
        use_external_data_format=external,
        # TensorRT only accepts symmetric (zero-point 0) int8 scales, and fuses float biases itself (an int32
        # DequantizeLinear on a bias is not an explicit-quantization pattern it supports).
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False},
    )
    return {"excluded_nodes": excluded, "unsafe_tensors": sorted(unsafe)}


def _verify(model_dir: Path, sample: np.ndarray, reference: np.ndarray) -> float:
    """Load a quantized directory, check logits are finite and shaped; return max |diff| vs FP32."""
    logits = OrtCausalLM(model_dir).logits(sample)
    if logits.shape != reference.shape or not np.isfinite(logits).all():
        raise LmforgeError(f"{model_dir}: quantized model produced non-finite or misshaped logits {logits.shape}")
    return float(np.max(np.abs(logits - reference)))


def heldout_tokens(shards: TokenShards, cfg: QuantizeConfig) -> np.ndarray:
    """The first ``gate_eval_tokens`` tokens of the ``val`` split, int64."""
    tokens = np.asarray(shards.tokens("val")[: cfg.gate_eval_tokens]).astype(np.int64)
    if tokens.size < 2:
        raise InputDataError(f"{shards.root}: the val split has {tokens.size} token(s); the accuracy gate needs 2+")
    return tokens


def _max_positions(onnx_dir: Path, default: int) -> int:
    file = onnx_dir / "config.json"
    found = max_positions(json.loads(file.read_text(encoding="utf-8"))) if file.is_file() else None
    return default if found is None else found


def html_section(metrics: dict[str, float], gates: dict[str, dict[str, Any]], facts: dict[str, Any]) -> str:
    """A short self-contained HTML section for the report: sizes, perplexities and the gate per INT8 model."""
    rows = [("fp32", metrics["fp32_size_mb"], metrics["fp32_perplexity"], "", "reference")]
    for name in ("dynamic", "qdq"):
        gate = gates[name]
        verdict = "accepted" if gate["accepted"] else "REJECTED"
        rows.append((name, metrics[f"{name}_size_mb"], gate["perplexity"], f"{gate['perplexity_delta']:+.2%}", verdict))
    body = "".join(
        f"<tr><td>{n}</td><td>{s:.2f}</td><td>{p:.4g}</td><td>{d}</td><td>{v}</td></tr>" for n, s, p, d, v in rows
    )
    reasons = "".join(f"<li>{html.escape(name)}: {html.escape(g['reason'])}</li>" for name, g in gates.items())
    excluded = facts.get("excluded_nodes") or []
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>INT8 quantization</title></head><body>"
        "<h2>INT8 quantization</h2><table border='1'><tr><th>model</th><th>size MB</th><th>perplexity</th>"
        f"<th>delta</th><th>gate</th></tr>{body}</table><ul>{reasons}</ul>"
        f"<p>Q/DQ: {html.escape(str(facts.get('calibrate_method')))} calibration on "
        f"{facts.get('calibration_sequences')} sequences; {len(excluded)} node(s) left in float.</p></body></html>"
    )


def model_graphs(onnx_dir: Path) -> list[str]:
    """The graphs of an ONNX model directory to quantize: the no-cache graph, then the cache graph when present."""
    return [NO_PAST_FILE] + ([WITH_PAST_FILE] if (onnx_dir / WITH_PAST_FILE).is_file() else [])


@dataclass(frozen=True)
class Fp32Reference:
    """What the INT8 models are measured against: the FP32 model's size, logits and held-out perplexity."""

    size_bytes: int
    sample: np.ndarray
    """The first (at most 2) calibration windows, on which the INT8 logits are checked."""
    logits: np.ndarray
    context: int
    """The perplexity context: ``gate_context``, at most the model's maximum positions."""
    perplexity: float


def fp32_reference(
    onnx_dir: Path, fp32_file: Path, windows: np.ndarray, heldout: np.ndarray, cfg: QuantizeConfig
) -> Fp32Reference:
    """Measure the FP32 model once: its size, its logits on a sample of ``windows`` and its held-out perplexity."""
    size_bytes = model_size_bytes(fp32_file)
    sample = windows[: min(len(windows), 2)]
    fp32_model = OrtCausalLM(fp32_file)
    logits = fp32_model.logits(sample)
    context = min(cfg.gate_context, _max_positions(onnx_dir, cfg.gate_context))
    ppl = perplexity(onnx_logits_fn(fp32_model), heldout, context=context).perplexity
    return Fp32Reference(size_bytes, sample, logits, context, ppl)


def calibration_reader(onnx_dir: Path, graph: str, windows: np.ndarray, batch_size: int) -> CalibrationDataReader:
    """The reader that calibrates ``graph``: plain windows for the no-cache graph, a prefilled past for the other."""
    if graph == NO_PAST_FILE:
        return TokenWindowReader(windows, batch_size)
    return PastWindowReader(windows, OrtDecoderWithPast(onnx_dir / graph), batch_size)


def _quantize_dynamic(src: Path, dst: Path, external: bool) -> None:
    """Write the dynamic-INT8 model of ``src``: int8 weights of MatMul/Gemm, activations quantized at run time."""
    quantize_dynamic(
        str(src),
        str(dst),
        op_types_to_quantize=list(DYNAMIC_OP_TYPES),
        weight_type=QuantType.QInt8,
        use_external_data_format=external,
    )


def quantize_graphs(
    onnx_dir: Path,
    graphs: Sequence[str],
    windows: np.ndarray,
    cfg: QuantizeConfig,
    *,
    dynamic_dir: Path,
    qdq_dir: Path,
    workdir: Path,
    external: bool,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Quantize each of ``graphs`` in ``onnx_dir`` both ways, into ``dynamic_dir`` and ``qdq_dir``.

    Returns:
        By graph: the tied-embedding sharing of the dynamic model, and the Q/DQ calibration facts.
    """
    tied_by_graph: dict[str, Any] = {}
    calibration_by_graph: dict[str, Any] = {}
    batch = even_batch_size(len(windows))
    for graph in graphs:
        prepared = workdir / graph
        preprocessed = _preprocess(onnx_dir / graph, prepared, external)
        src = prepared if preprocessed else onnx_dir / graph
        _quantize_dynamic(src, dynamic_dir / graph, external)
        if cfg.share_tied_embedding:
            tied_by_graph[graph] = share_tied_embedding_file(dynamic_dir / graph, external=external)
        reader = calibration_reader(onnx_dir, graph, windows, batch)
        facts = quantize_qdq(src, qdq_dir / graph, reader, cfg, external=external, workdir=workdir / f"{graph}.calib")
        calibration_by_graph[graph] = {"preprocessed": preprocessed, **facts}
    return tied_by_graph, calibration_by_graph


def accuracy_gate(
    name: str, model_dir: Path, heldout: np.ndarray, fp32: Fp32Reference, cfg: QuantizeConfig
) -> dict[str, Any]:
    """The gate record of the INT8 model in ``model_dir``: its held-out perplexity against the FP32 one."""
    ppl = perplexity(onnx_logits_fn(OrtCausalLM(model_dir)), heldout, context=fp32.context).perplexity
    gate = {
        **gate_decision(fp32.perplexity, ppl, cfg.max_perplexity_delta),
        "context": fp32.context,
        "tokens": int(heldout.size),
    }
    log.log(logging.INFO if gate["accepted"] else logging.WARNING, "INT8 %s %s", name, gate["reason"])
    return gate


def gate_metrics(gates: dict[str, dict[str, Any]]) -> dict[str, float]:
    """``<model>_perplexity``, ``<model>_perplexity_delta`` and ``<model>_accepted`` (1 or 0) per gated model."""
    metrics: dict[str, float] = {}
    for name, gate in gates.items():
        metrics[f"{name}_perplexity"] = gate["perplexity"]
        metrics[f"{name}_perplexity_delta"] = gate["perplexity_delta"]
        metrics[f"{name}_accepted"] = 1.0 if gate["accepted"] else 0.0
    return metrics


def int8_metrics(
    fp32: Fp32Reference,
    *,
    dynamic_dir: Path,
    qdq_dir: Path,
    calibration_sequences: int,
    excluded_nodes: int,
) -> dict[str, float]:
    """Sizes, the INT8 logits' distance from FP32 on the sample (each model checked finite) and calibration counts."""
    return {
        "fp32_size_mb": fp32.size_bytes / 1e6,
        "dynamic_size_mb": model_size_bytes(dynamic_dir / NO_PAST_FILE) / 1e6,
        "qdq_size_mb": model_size_bytes(qdq_dir / NO_PAST_FILE) / 1e6,
        "calibration_sequences": float(calibration_sequences),
        "dynamic_max_abs_diff": _verify(dynamic_dir, fp32.sample, fp32.logits),
        "qdq_max_abs_diff": _verify(qdq_dir, fp32.sample, fp32.logits),
        "fp32_perplexity": fp32.perplexity,
        "qdq_excluded_nodes": float(excluded_nodes),
    }


def dynamic_facts(tied_by_graph: dict[str, Any]) -> dict[str, Any]:
    """What the dynamic-INT8 manifest says about its quantization."""
    return {
        "quantization": "dynamic-int8",
        "op_types": list(DYNAMIC_OP_TYPES),
        "per_channel": False,
        "tied_embedding": tied_by_graph,
    }


def qdq_facts(cfg: QuantizeConfig, calibration_sequences: int, calibration_by_graph: dict[str, Any]) -> dict[str, Any]:
    """What the Q/DQ INT8 manifest says about its quantization and calibration."""
    return {
        "quantization": "qdq-int8",
        "op_types": list(cfg.op_types),
        "per_channel": cfg.per_channel,
        "symmetric": True,
        "activation_type": "int8",
        "calibrate_method": cfg.calibrate_method,
        "calibration_sequences": calibration_sequences,
        "calibration_seq_len": cfg.calibration_seq_len,
        "calibration": calibration_by_graph,
    }


def _log_outcome(onnx_dir: Path, metrics: dict[str, float], gates: dict[str, dict[str, Any]], method: str) -> None:
    def verdict(name: str) -> str:
        return "accepted" if gates[name]["accepted"] else "rejected"

    log.info(
        "quantized %s: fp32 %.2f MB, dynamic %.2f MB (%s), qdq %.2f MB (%s), %d calibration sequences, %s",
        onnx_dir,
        metrics["fp32_size_mb"],
        metrics["dynamic_size_mb"],
        verdict("dynamic"),
        metrics["qdq_size_mb"],
        verdict("qdq"),
        metrics["calibration_sequences"],
        method,
    )


def run(
    cfg: QuantizeConfig,
    *,
    onnx_model: str | Path,
    shards: str | Path,
    int8_dynamic: str | Path,
    int8_qdq: str | Path,
) -> StageResult:
    """Write a dynamic-INT8 model to ``int8_dynamic`` and a calibrated Q/DQ INT8 model to ``int8_qdq``, gated."""
    start = time.perf_counter()
    onnx_model = Path(onnx_model)
    fp32_file = resolve_model_file(onnx_model)
    source = input_record(onnx_model)
    token_shards = TokenShards.open(shards)
    check_tokenizer_match(onnx_model, token_shards)
    windows = calibration_windows(token_shards.tokens("train"), cfg.calibration_sequences, cfg.calibration_seq_len)
    heldout = heldout_tokens(token_shards, cfg)
    graphs = model_graphs(onnx_model)
    fp32 = fp32_reference(onnx_model, fp32_file, windows, heldout, cfg)
    inputs = {"onnx_model": source, "shards": input_record(token_shards.root)}

    with (
        tempfile.TemporaryDirectory(prefix="lmforge-quant-") as tmp,
        staged_output(int8_dynamic) as dyn_out,
        staged_output(int8_qdq) as qdq_out,
    ):
        tied_by_graph, calibration_by_graph = quantize_graphs(
            onnx_model,
            graphs,
            windows,
            cfg,
            dynamic_dir=dyn_out,
            qdq_dir=qdq_out,
            workdir=Path(tmp),
            external=fp32.size_bytes > EXTERNAL_DATA_BYTES,
        )
        gates = {
            name: accuracy_gate(name, out, heldout, fp32, cfg) for name, out in (("dynamic", dyn_out), ("qdq", qdq_out))
        }
        excluded = calibration_by_graph[NO_PAST_FILE]["excluded_nodes"]
        metrics = {
            **int8_metrics(
                fp32,
                dynamic_dir=dyn_out,
                qdq_dir=qdq_out,
                calibration_sequences=len(windows),
                excluded_nodes=len(excluded),
            ),
            **gate_metrics(gates),
        }
        metrics["quantize_seconds"] = time.perf_counter() - start
        qdq = qdq_facts(cfg, len(windows), calibration_by_graph)
        for out, facts, gate in (
            (dyn_out, dynamic_facts(tied_by_graph), gates["dynamic"]),
            (qdq_out, qdq, gates["qdq"]),
        ):
            copy_model_files(onnx_model, out)
            extra = {"graphs": graphs, "weight_type": "int8", **facts, GATE_KEY: gate}
            write_manifest(out, "onnx-model", inputs=inputs, config=cfg.model_dump(), metrics=metrics, extra=extra)
    _log_outcome(onnx_model, metrics, gates, cfg.calibrate_method)
    return StageResult(
        metrics=metrics,
        html=html_section(metrics, gates, {**qdq, "excluded_nodes": excluded}),
        summary={
            "dynamic_dir": str(int8_dynamic),
            "qdq_dir": str(int8_qdq),
            "graphs": graphs,
            "accuracy_gate": gates,
            "calibration": calibration_by_graph,
        },
    )
