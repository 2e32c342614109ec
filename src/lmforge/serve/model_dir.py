"""Which exported model a release serves, and the facts about it the predictor needs.

A path given to the predictor is either a release (``models/<name>/<version>/``, whose ``manifest.json`` has
``kind: release``) or an ONNX model directory written by ``export_onnx`` or ``quantize_int8`` (holding
``model.onnx``, the decoder with a KV cache, the tokenizer and ``config.json``). From a release the predictor
serves, on CPU, the dynamic INT8 model when the release has one (``promote`` only releases INT8 models whose accuracy
gate accepted them) and ``prefer_int8`` is on, else the FP32 ONNX model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge import storage
from lmforge.artifacts import MANIFEST, read_json_file
from lmforge.errors import InputDataError
from lmforge.onnx_runtime import WITH_PAST_FILE

RELEASE_KIND = "release"
INT8_DYNAMIC = "int8_dynamic"
ONNX_FP32 = "onnx_fp32"
STUDENT = "student"  # the release's Hugging Face model directory (config.json, safetensors, tokenizer)
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class ServedModel:
    """The ONNX model directory to serve and where it came from."""

    path: Path
    """ONNX model directory holding ``model.onnx`` (the cache graph), ``config.json`` and the tokenizer."""
    artifact: str
    """Release folder it is (``int8_dynamic``, ``onnx_fp32``), or the directory's name outside a release."""
    name: str
    """Default model name in the routes: the release's model name, else the directory's name."""
    version: str | None
    """Release version, or ``None`` outside a release."""
    reason: str
    """Why this directory was chosen (logged at start-up)."""


def is_release(path: str | Path) -> bool:
    """True when ``path`` holds a release manifest (``kind: release``)."""
    file = Path(path, MANIFEST)
    if not file.is_file():
        return False
    manifest = read_json_file(file)
    return isinstance(manifest, dict) and manifest.get("kind") == RELEASE_KIND


def _check_onnx_dir(path: Path) -> None:
    for name in (WITH_PAST_FILE, CONFIG_FILE, "tokenizer.json"):
        if not (path / name).is_file():
            hint = " (export with export_onnx.with_past: true)" if name == WITH_PAST_FILE else ""
            raise InputDataError(f"{path}: no {name}; not an lmforge ONNX model directory{hint}")


def resolve_served_model(path: str | Path, *, prefer_int8: bool = True) -> ServedModel:
    """The model directory to serve for a release or an ONNX model directory ``path``.

    Raises:
        InputDataError: ``path`` is neither, or the chosen directory lacks the KV-cache graph or the tokenizer.
    """
    path = Path(path)
    if not path.is_dir():
        raise InputDataError(f"model path not found: {path} (give a release models/<name>/<version>/ or a model dir)")
    if not is_release(path):
        _check_onnx_dir(path)
        return ServedModel(path, path.name, _safe_name(path.name), None, f"{path}: ONNX model directory")
    manifest = read_json_file(path / MANIFEST)
    artifacts: dict[str, Any] = manifest.get("artifacts") or {}
    withheld: dict[str, str] = manifest.get("withheld") or {}
    order = [INT8_DYNAMIC, ONNX_FP32] if prefer_int8 else [ONNX_FP32]
    for artifact in order:
        if artifact in artifacts and (path / artifact / WITH_PAST_FILE).is_file():
            chosen = path / artifact
            _check_onnx_dir(chosen)
            why = f"release {manifest.get('version')}: serving {artifact}"
            if artifact == ONNX_FP32 and prefer_int8:
                why += f" ({INT8_DYNAMIC} {withheld.get(INT8_DYNAMIC, 'is not in the release')})"
            return ServedModel(
                chosen, artifact, str(manifest.get("model_name") or path.parent.name), manifest.get("version"), why
            )
    raise InputDataError(
        f"release {path}: no servable ONNX model ({' or '.join(order)} with {WITH_PAST_FILE}); "
        f"it holds {sorted(artifacts)}"
    )


def fetch_release(uri: str, workdir: str | Path, *, prefer_int8: bool = True) -> Path:
    """A local copy of what the predictor reads from an ``s3://`` release or model directory ``uri``.

    A release is fetched as its manifest and the one ONNX folder :func:`resolve_served_model` will pick (not the
    student, the Q/DQ model or the engine); any other prefix as a whole. A local ``uri`` is returned as it is.
    """
    if not storage.is_s3(uri):
        return Path(uri)
    manifest_uri = storage.join(uri, MANIFEST)
    if not storage.is_file(manifest_uri):
        return storage.localize(uri, workdir)
    local = storage.localize(manifest_uri, workdir).parent
    manifest = read_json_file(local / MANIFEST)
    if not isinstance(manifest, dict) or manifest.get("kind") != RELEASE_KIND:
        return storage.localize(uri, workdir)
    artifacts = manifest.get("artifacts") or {}
    for artifact in [INT8_DYNAMIC, ONNX_FP32] if prefer_int8 else [ONNX_FP32]:
        if artifact in artifacts and storage.is_file(storage.join(uri, artifact, WITH_PAST_FILE)):
            storage.localize(storage.join(uri, artifact), workdir)
            break
    return local


def context_length(model_dir: str | Path) -> int:
    """The model's context (``n_positions`` / ``max_position_embeddings`` of ``config.json``)."""
    file = Path(model_dir, CONFIG_FILE)
    config = json.loads(file.read_text(encoding="utf-8"))
    for key in ("n_positions", "max_position_embeddings", "n_ctx"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return int(config[key])
    raise InputDataError(f"{file}: no n_positions or max_position_embeddings; cannot bound the prompt length")


def _safe_name(name: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "._-" else "-" for c in name.lower()).strip("-._")
    return cleaned or "model"
