"""What a checkpoint must hold for the training loop to resume from it, checked before it is chosen.

A checkpoint whose manifest verifies can still be unusable: a ``trainer_state.json`` or ``rng.json`` of the
wrong shape, weights whose tensors are not the model's, an optimizer state for other parameters. Each check
here reads a file the way resume will and raises :class:`~lmforge.errors.ArtifactIncompleteError` naming the
file and what is wrong, so that :meth:`~lmforge.train.checkpoint.Checkpointer.fetch_newest_valid` moves the
checkpoint aside and tries an older one instead of failing every resume. Nothing is loaded into the model.
"""

from __future__ import annotations

import json
import random
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.errors import ArtifactIncompleteError

TRAINER_STATE = "trainer_state.json"
RNG_STATE = "rng.json"
MODEL_STATE = "model.safetensors"
OPTIMIZER_STATE = "optimizer.pt"
_STATE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "step": int,
    "global_batch": int,
    "seed": int,
    "scaler": (dict, type(None)),
    "bad_in_row": int,
    "window": dict,
    "history": dict,
}
_WINDOW_FIELDS = ("loss", "steps", "tokens", "seconds")


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ArtifactIncompleteError(f"{path}: not readable JSON ({type(exc).__name__}: {exc})") from exc


def read_trainer_state(folder: Path, step: int) -> dict[str, Any]:
    """``trainer_state.json`` of the checkpoint of ``step``, checked field by field."""
    path = folder / TRAINER_STATE
    state = _json(path)
    if not isinstance(state, dict):
        raise ArtifactIncompleteError(f"{path}: not a JSON object")
    for field, kind in _STATE_FIELDS.items():
        value = state.get(field)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ArtifactIncompleteError(f"{path}: {field!r} is missing or of the wrong type ({type(value).__name__})")
    if state["step"] != step:
        raise ArtifactIncompleteError(f"{path}: step {state['step']}, but the checkpoint is step {step}")
    if missing := [f for f in _WINDOW_FIELDS if not isinstance(state["window"].get(f), int | float)]:
        raise ArtifactIncompleteError(f"{path}: 'window' lacks the numbers {', '.join(missing)}")
    return state


def read_rng_states(folder: Path) -> list[Mapping[str, Any]]:
    """``rng.json``: one state per rank, each applied to a scratch generator first to prove it loads."""
    path = folder / RNG_STATE
    states = _json(path)
    if not isinstance(states, list) or not states:
        raise ArtifactIncompleteError(f"{path}: expected a non-empty list of per-rank RNG states")
    for rank, state in enumerate(states):
        try:
            torch.Generator().set_state(torch.tensor(state["torch"], dtype=torch.uint8))
            if state["cuda"] is not None and not isinstance(state["cuda"], list):
                raise TypeError("'cuda' is neither null nor a list")
            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.RandomState().set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
            version, internal, gauss = state["python"]
            random.Random().setstate((version, tuple(internal), gauss))
        except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise ArtifactIncompleteError(f"{path}: the RNG state of rank {rank} does not load ({exc!r})") from exc
    return states


def check_model_weights(path: Path, model: torch.nn.Module) -> None:
    """The tensors of ``model.safetensors`` are exactly the model's, by name and shape (read from its header).

    A tensor that shares storage with one in the file (tied embeddings, which safetensors saves once) may be
    absent, as ``safetensors.torch.load_model`` allows.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as fh:
            shapes = {name: tuple(fh.get_slice(name).get_shape()) for name in fh.keys()}  # noqa: SIM118
    except (OSError, SafetensorError) as exc:
        raise ArtifactIncompleteError(f"{path}: not a readable safetensors file ({exc})") from exc
    expected = model.state_dict()
    for name, shape in shapes.items():
        if name not in expected:
            raise ArtifactIncompleteError(f"{path}: tensor {name!r} is not a parameter or buffer of the model")
        if shape != tuple(expected[name].shape):
            raise ArtifactIncompleteError(
                f"{path}: tensor {name!r} has shape {list(shape)}, the model's is {list(expected[name].shape)}"
            )
    stored = {expected[name].untyped_storage().data_ptr() for name in shapes}
    missing = [n for n, t in expected.items() if n not in shapes and t.untyped_storage().data_ptr() not in stored]
    if missing:
        raise ArtifactIncompleteError(f"{path}: the model's {missing[0]!r} is missing ({len(missing)} tensors in all)")


def check_optimizer_state(path: Path, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer state in ``path`` is for ``optimizer``'s parameter groups, with tensors of their shapes."""
    from lmforge.train.checkpoint import load_tensor_file

    saved = load_tensor_file(path, mmap=zipfile.is_zipfile(path))  # check_tensor_only has accepted it already
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    state = saved.get("state") if isinstance(saved, dict) else None
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if not isinstance(groups, list) or not isinstance(state, dict):
        raise ArtifactIncompleteError(f"{path}: not an optimizer state (no 'param_groups' and 'state')")
    saved_sizes = [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in groups]
    if saved_sizes != sizes:
        raise ArtifactIncompleteError(f"{path}: parameter groups of sizes {saved_sizes}, the optimizer's are {sizes}")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in groups for i in g["params"]]
    for index, param in zip(ids, params, strict=True):
        for key, value in (state.get(index) or {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise ArtifactIncompleteError(
                    f"{path}: {key} of parameter {index} has shape {list(value.shape)}, the parameter's is "
                    f"{list(param.shape)}"
                )
