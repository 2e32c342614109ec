"""One int8 table for a tied embedding and LM head in a dynamically quantized ONNX graph.

GPT-2 (and most small causal LMs) tie the token embedding to the LM head. After ``quant_pre_process``
folds the head's ``Transpose(wte)`` into an initializer, ``quantize_dynamic`` turns the head into an int8
``[hidden, vocab]`` table for ``MatMulInteger`` while the embedding ``Gather`` keeps the FP32 ``[vocab, hidden]``
table: the vocabulary is stored twice, once in FP32, which alone keeps the model at ~0.55× its FP32 size.

:func:`share_tied_embedding` finds that pair (the int8 head table dequantizes to the transposed FP32 table
within half a quantization step) and rewrites the lookup to read the int8 head table::

    Gather(E, ids)  ->  Reshape(DequantizeLinear(Transpose(Gather(Q, Reshape(ids, [-1]), axis=1))),
                                Concat(Shape(ids), [hidden]))

Only the looked-up columns are transposed and dequantized (``tokens × hidden`` values, not the table), and the
FP32 table is dropped. The embedding then carries the head's int8 rounding; the accuracy gate measures it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from lmforge.onnx_runtime import external_data_files

_INT8_TYPES = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)


@dataclass(frozen=True)
class TiedPair:
    """An embedding ``Gather`` node and the int8 head table that holds the same (transposed) weights."""

    gather: onnx.NodeProto
    fp32_table: str
    int8_table: str
    scale: str
    zero_point: str


def _initializers(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    return {init.name: init for init in graph.initializer}


def _head_tables(graph: onnx.GraphProto, inits: dict[str, onnx.TensorProto]) -> list[tuple[str, str, str]]:
    """``(int8 table, scale, zero point)`` of every ``MatMulInteger`` whose B side is a per-tensor int8 initializer.

    ``quantize_dynamic`` names a weight's scale ``<weight>_scale`` and feeds its zero point as B's zero point.
    """
    found = []
    for node in graph.node:
        if node.op_type != "MatMulInteger" or len(node.input) < 4:
            continue
        table, zero_point = node.input[1], node.input[3]
        scale = table.removesuffix("_quantized") + "_scale"
        if not (table in inits and scale in inits and zero_point in inits):
            continue
        per_tensor = np.prod(inits[scale].dims, dtype=np.int64) == 1
        if per_tensor and inits[table].data_type in _INT8_TYPES and len(inits[table].dims) == 2:
            found.append((table, scale, zero_point))
    return found


def find_tied_pairs(model: onnx.ModelProto) -> list[TiedPair]:
    """Embedding ``Gather`` nodes whose FP32 table is a quantized head table, transposed."""
    graph = model.graph
    inits = _initializers(graph)
    heads = _head_tables(graph, inits)
    pairs = []
    for node in graph.node:
        if node.op_type != "Gather" or node.input[0] not in inits:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        table = inits[node.input[0]]
        if axis != 0 or table.data_type != onnx.TensorProto.FLOAT or len(table.dims) != 2:
            continue
        fp32 = numpy_helper.to_array(table)
        for int8_name, scale_name, zp_name in heads:
            if tuple(inits[int8_name].dims) != fp32.shape[::-1]:
                continue
            scale = float(numpy_helper.to_array(inits[scale_name]).reshape(()))
            zero = numpy_helper.to_array(inits[zp_name]).astype(np.int32).reshape(())
            dequant = (numpy_helper.to_array(inits[int8_name]).astype(np.int32) - zero).astype(np.float32) * scale
            if np.max(np.abs(dequant.T - fp32)) <= 0.5 * scale * (1 + 1e-3) + 1e-12:
                pairs.append(TiedPair(node, node.input[0], int8_name, scale_name, zp_name))
                break
    return pairs


def _lookup_nodes(pair: TiedPair, hidden: int, prefix: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Nodes computing ``pair.gather``'s output from the int8 head table, and the constants they need."""
    ids, out = pair.gather.input[1], pair.gather.output[0]
    flat_shape = numpy_helper.from_array(np.array([-1], dtype=np.int64), f"{prefix}_flat_shape")
    hidden_dim = numpy_helper.from_array(np.array([hidden], dtype=np.int64), f"{prefix}_hidden")
    nodes = [
        helper.make_node("Reshape", [ids, flat_shape.name], [f"{prefix}_ids_flat"], name=f"{prefix}_flatten"),
        helper.make_node(
            "Gather", [pair.int8_table, f"{prefix}_ids_flat"], [f"{prefix}_cols"], name=f"{prefix}_gather", axis=1
        ),
        helper.make_node("Transpose", [f"{prefix}_cols"], [f"{prefix}_rows"], name=f"{prefix}_rows", perm=[1, 0]),
        helper.make_node(
            "DequantizeLinear",
            [f"{prefix}_rows", pair.scale, pair.zero_point],
            [f"{prefix}_rows_fp32"],
            name=f"{prefix}_dequantize",
        ),
        helper.make_node("Shape", [ids], [f"{prefix}_ids_shape"], name=f"{prefix}_ids_shape"),
        helper.make_node(
            "Concat", [f"{prefix}_ids_shape", hidden_dim.name], [f"{prefix}_out_shape"], name=f"{prefix}_shape", axis=0
        ),
        helper.make_node("Reshape", [f"{prefix}_rows_fp32", f"{prefix}_out_shape"], [out], name=f"{prefix}_reshape"),
    ]
    return nodes, [flat_shape, hidden_dim]


def share_tied_embedding(model: onnx.ModelProto) -> dict[str, Any]:
    """Rewrite ``model`` in place so tied embedding lookups read the int8 head table; return what changed.

    Returns ``{"shared_tables": n, "bytes_removed": b}``; ``n == 0`` when the graph has no tied pair (an untied
    model, or a head left in FP32), in which case nothing is touched.
    """
    graph = model.graph
    pairs = find_tied_pairs(model)
    removed = 0
    for index, pair in enumerate(pairs):
        hidden = int(_initializers(graph)[pair.int8_table].dims[0])
        nodes, constants = _lookup_nodes(pair, hidden, f"tied_embedding_{index}")
        position = list(graph.node).index(pair.gather)
        graph.node.remove(pair.gather)
        for offset, node in enumerate(nodes):
            graph.node.insert(position + offset, node)
        graph.initializer.extend(constants)
        still_used = any(pair.fp32_table in node.input for node in graph.node)
        if not still_used:
            table = _initializers(graph)[pair.fp32_table]
            removed += int(np.prod(table.dims, dtype=np.int64)) * 4
            graph.initializer.remove(table)
    return {"shared_tables": len(pairs), "bytes_removed": removed}


def share_tied_embedding_file(path: Path, *, external: bool) -> dict[str, Any]:
    """:func:`share_tied_embedding` on the ONNX file ``path``, rewritten in place (external data kept external).

    Meant for a file inside a staged output directory: the directory, not this file, is committed atomically.
    """
    model = onnx.load(str(path))
    facts = share_tied_embedding(model)
    if facts["shared_tables"]:
        for stale in external_data_files(path):  # its tensors are in memory now; a smaller file replaces it
            stale.unlink()
        onnx.save_model(
            model, str(path), save_as_external_data=external, all_tensors_to_one_file=True, location=f"{path.name}.data"
        )
    return facts
