"""Distributed checkpoints (``torch.distributed.checkpoint``) of an FSDP2 model and its optimizer.

Every rank writes its own shards into ``<checkpoint>/dcp/`` (``__<rank>_0.distcp``) and rank 0 the index
(``.metadata``); the state is keyed by parameter name with each tensor's global shape, so a checkpoint saved on one
mesh loads on any other (one process, more data-parallel ranks, another tensor-parallel degree): DCP reads the
pieces each rank's new shards need. A GPT-2 split by tensor parallelism holds its fused q/k/v columns in another order
(:mod:`lmforge.train.tensor_parallel`); they are written and read in Hugging Face's order.

Trust, as for every checkpoint (:mod:`lmforge.train.checkpoint`): nothing read back can run code. DCP's own
reader unpickles ``.metadata`` and the non-tensor entries (the optimizer's hyperparameters) with the full
unpickler; here the index is written with pickle protocol 2 and read with PyTorch's ``weights_only`` unpickler,
allowing only DCP's plain metadata classes, and the entries with ``torch.load(weights_only=True)``, as the tensors
already are.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.storage import WriteResult

from lmforge.errors import ArtifactIncompleteError
from lmforge.train.pipeline import pipeline_of
from lmforge.train.tensor_parallel import hf_ordered_state, load_hf_ordered

DCP_DIR = "dcp"
METADATA = ".metadata"
_MODEL, _OPTIMIZER, _STATE = "model", "optimizer", "state"


def _metadata_classes() -> list[Any]:
    """The plain data classes DCP pickles into ``.metadata``: shapes, dtypes, chunk offsets, file offsets."""
    return [
        dcp_metadata.Metadata,
        dcp_metadata.TensorStorageMetadata,
        dcp_metadata.BytesStorageMetadata,
        dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.TensorProperties,
        dcp_metadata.StorageMeta,
        dcp_metadata.MetadataIndex,
        dcp_metadata._MEM_FORMAT_ENCODING,
        _StorageInfo,
        torch.Size,
        type(Path()),  # where it was written (StorageMeta.checkpoint_id)
    ]


def read_metadata(path: Path) -> dcp_metadata.Metadata:
    """The checkpoint index at ``path`` (a ``.metadata`` file), unpickled with the ``weights_only`` unpickler."""
    from torch import _weights_only_unpickler

    with open(path, "rb") as fh, torch.serialization.safe_globals(_metadata_classes()):
        return _weights_only_unpickler.Unpickler(fh, encoding="utf-8").load()


class Protocol2Writer(FileSystemWriter):
    """DCP's file writer, pickling the index with protocol 2: the one the ``weights_only`` unpickler reads."""

    def finish(self, metadata: dcp_metadata.Metadata, results: list[list[WriteResult]]) -> None:
        """Write the index (``.metadata``) once every rank's shards are written (rank 0)."""
        super().finish(metadata, results)  # completes ``metadata`` and writes it with the default protocol
        path = Path(self.path) / METADATA
        staged = path.with_name(f"{METADATA}.protocol2")
        staged.write_bytes(pickle.dumps(metadata, protocol=2))
        staged.replace(path)


class TensorOnlyReader(FileSystemReader):
    """DCP's file reader, reading the index with :func:`read_metadata` instead of the full unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        """The index of this checkpoint (the same object DCP's reader returns)."""
        metadata = read_metadata(Path(self.path) / METADATA)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Set one non-tensor entry (a number, string or tuple of them) of the state being loaded."""
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _renamed(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    return {names.get(name, name): value for name, value in state.items()}


def _tied_names(model: torch.nn.Module) -> dict[str, str]:
    pipeline = pipeline_of(model)
    return pipeline.tied_names if pipeline is not None else {}


def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Write this rank's shards of the model and optimizer state under ``folder/dcp`` (called on every rank).

    The optimizer's per-parameter state is saved, keyed by parameter name (the last pipeline stage's copy of a
    tied embedding under the embedding's name, as one process keys it); its parameter groups are not: they list
    each rank's own parameters, and each run takes them from its config.
    """
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {_MODEL: model_state, _OPTIMIZER: {_STATE: _renamed(optimizer_state[_STATE], _tied_names(model))}}
    dcp.save(hf_ordered_state(model, state), storage_writer=Protocol2Writer(folder / DCP_DIR))


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Load the model and optimizer state of ``folder/dcp`` into this rank's shards, whatever mesh wrote it."""
    names = _tied_names(model)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {_MODEL: model_state, _OPTIMIZER: {_STATE: _renamed(optimizer_state[_STATE], names)}}
    ordered = hf_ordered_state(model, state)
    dcp.load(ordered, storage_reader=TensorOnlyReader(folder / DCP_DIR), planner=TensorOnlyLoadPlanner())
    load_hf_ordered(model, state, ordered)
    back = {saved: own for own, saved in names.items()}
    optimizer_state[_STATE] = _renamed(state[_OPTIMIZER][_STATE], back)
    set_state_dict(model, optimizer, model_state_dict=state[_MODEL], optim_state_dict=optimizer_state)


def check(folder: Path, model: torch.nn.Module) -> None:
    """The checkpoint's index holds exactly the model's tensors, by name and global shape (a pipeline stage's
    tensors among the other stages').

    Raises:
        ArtifactIncompleteError: the index is missing or unreadable, or a tensor is missing, extra or of another
            shape (named).
    """
    path = folder / DCP_DIR / METADATA
    try:
        metadata = read_metadata(path)
    except Exception as exc:  # a torn or hostile index makes the unpickler raise almost anything
        raise ArtifactIncompleteError(f"{path}: not a readable checkpoint index ({type(exc).__name__}: {exc})") from exc
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise ArtifactIncompleteError(f"{path}: holds a {type(metadata).__name__}, not a checkpoint index")
    saved = {
        name.removeprefix(f"{_MODEL}."): tuple(meta.size)
        for name, meta in metadata.state_dict_metadata.items()
        if name.startswith(f"{_MODEL}.") and isinstance(meta, dcp_metadata.TensorStorageMetadata)
    }
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    others = saved.keys() - expected.keys() if pipeline_of(model) is not None else set()  # other stages' tensors
    for name in sorted((saved.keys() ^ expected.keys()) - others):
        where = "the checkpoint" if name in saved else "the model"
        raise ArtifactIncompleteError(f"{path}: tensor {name!r} is only in {where}")
    for name, shape in saved.items():
        if name in expected and shape != expected[name]:
            raise ArtifactIncompleteError(
                f"{path}: tensor {name!r} has shape {list(shape)}, the model's is {list(expected[name])}"
            )
