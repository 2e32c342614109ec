"""What lmforge accepts in a Hugging Face model folder before ``transformers`` reads it.

A model folder comes from outside (a base model, a teacher), so two of its files could reach beyond it:

* ``auto_map`` in ``config.json`` or ``tokenizer_config.json`` names Python code in the folder that
  ``transformers`` runs (after asking ``trust_remote_code``); lmforge loads built-in architectures only, so a
  folder carrying one is refused (:func:`custom_code_problem`), and every ``from_pretrained`` passes
  ``trust_remote_code=False`` besides.
* ``model.safetensors.index.json`` maps tensors to weight files by name; a name such as
  ``../elsewhere.safetensors`` would load weights from outside the folder, which its fingerprint does not
  cover. Every weight file must be a plain name inside the folder, present, and listed in the folder's
  ``manifest.json`` when it has one (:func:`weight_files`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmforge import storage
from lmforge.artifacts import read_json_file
from lmforge.errors import InputDataError, UnsafePathError

WEIGHTS = "model.safetensors"
WEIGHT_INDEX = "model.safetensors.index.json"
WEIGHT_FILES = (WEIGHTS, WEIGHT_INDEX)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)
"""A model folder's tokenizer files: what ``lmforge.model.base.check_base_model`` downloads to read a remote base's
tokenizer (the weights stay where they are)."""
CUSTOM_CODE_FILES = ("config.json", "tokenizer_config.json")
"""Files whose ``auto_map`` makes ``transformers`` import code from the model folder."""


def _json_object(path: Path) -> dict[str, Any]:
    data = read_json_file(path)
    if not isinstance(data, dict):
        raise InputDataError(f"{path}: not a JSON object")
    return data


def custom_code_problem(name: str, config: Mapping[str, Any]) -> str | None:
    """Why the ``config.json``/``tokenizer_config.json`` mapping ``config`` (file ``name``) is refused, or ``None``."""
    auto_map = config.get("auto_map")
    if auto_map is None:
        return None
    classes = ", ".join(sorted(map(str, auto_map))) if isinstance(auto_map, Mapping) else repr(auto_map)[:80]
    return (
        f"{name} has auto_map ({classes}): custom Python code that transformers would run; lmforge loads "
        "built-in architectures only and never runs code from a model folder (trust_remote_code=False)"
    )


def refuse_custom_code(folder: str | Path) -> None:
    """Raise :class:`InputDataError`, naming the folder and file, when a :data:`CUSTOM_CODE_FILES` has ``auto_map``."""
    for name in CUSTOM_CODE_FILES:
        path = Path(folder, name)
        if path.is_file() and (problem := custom_code_problem(name, _json_object(path))):
            raise InputDataError(f"model directory {folder}: {problem}")


def index_problem(index: Mapping[str, Any], present: set[str]) -> str | None:
    """Why a ``model.safetensors.index.json`` mapping is refused given the folder's file names, or ``None``."""
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, Mapping) or not weight_map:
        return f"{WEIGHT_INDEX} has no weight_map"
    for name in sorted(set(map(str, weight_map.values()))):
        try:
            storage.check_name(name, WEIGHT_INDEX)
        except UnsafePathError as exc:
            return f"{exc}: every weight file must be inside the model folder"
        if name not in present:
            return f"{WEIGHT_INDEX} names {name}, which is not in the model folder"
    return None


def weight_files(folder: str | Path) -> list[str]:
    """The weight files ``transformers`` will read from ``folder``, each checked to be a regular file inside it.

    Raises:
        InputDataError: no weights; an index naming a file outside the folder or a missing one; a symbolic
            link in the folder (:class:`UnsafePathError`); or a weight file its ``manifest.json`` does not list.
    """
    folder = Path(folder)
    present = set(storage.local_files(folder))  # refuses a symbolic link anywhere in the folder
    if WEIGHTS in present:
        names = [WEIGHTS]
    elif WEIGHT_INDEX in present:
        index = _json_object(folder / WEIGHT_INDEX)
        if problem := index_problem(index, present):
            raise InputDataError(f"model directory {folder}: {problem}")
        names = [WEIGHT_INDEX, *sorted(set(index["weight_map"].values()))]
    else:
        raise InputDataError(f"model directory {folder}: no weights ({' or '.join(WEIGHT_FILES)})")
    manifest = folder / "manifest.json"
    if manifest.is_file():
        listed = _json_object(manifest).get("files")
        unlisted = [n for n in names if not isinstance(listed, Mapping) or n not in listed]
        if unlisted:
            raise InputDataError(
                f"model directory {folder}: {', '.join(unlisted)} not listed in manifest.json, so its fingerprint "
                "would not cover them"
            )
    return names
