"""The ``serve`` stage: the KServe objects for a release, created or updated in the cluster when ``serve.apply`` is on.

Input ``release``: the release URI ``<release_root>/models/<name>/<version>`` (local or ``s3://``) that ``promote``
wrote. Output directory ``serving``:

* ``inferenceservice.yaml`` — the ``InferenceService`` (:func:`lmforge.serve.manifests.build_inference_service`);
* ``servingruntime.yaml`` — the lmforge ``ServingRuntime`` (lmforge runtime only);
* ``triton/<service>/config.pbtxt`` + ``1/model.onnx|model.plan`` — the Triton model repository (triton runtime
  only), also copied to ``<release>/triton/``, where the ``storageUri`` points: a release gains that folder, nothing
  in it is overwritten (a second serve of the same release refuses a different repository);
* ``status.json`` — the apply: ``applied`` (Ready, with the URL) or ``skipped`` with the reason (``no cluster``
  under ``kfp.local``, or ``serve.apply`` off), and ``local_command``: the ``lmforge serve`` line that starts the
  same predictor on this machine;
* ``manifest.json``.

The lmforge runtime serves ``<release>/int8_dynamic`` (CPU, when the release has it) or ``<release>/onnx_fp32``; the
triton runtime the TensorRT engine when it was built, else ``onnx_fp32/decoder_model.onnx`` (no KV cache); the
huggingface runtime ``<release>/student``, with the context its ``config.json`` declares as ``--max_model_len``.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import yaml

from lmforge import storage
from lmforge.artifacts import MANIFEST, staged_output, write_manifest
from lmforge.config.base import validate_config
from lmforge.config.launch import TolerationConfig
from lmforge.config.serve import ServeConfig
from lmforge.contracts import max_positions
from lmforge.errors import InputDataError
from lmforge.onnx_runtime import NO_PAST_FILE
from lmforge.results import StageResult
from lmforge.serve.apply import apply_and_wait
from lmforge.serve.manifests import (
    ENGINE,
    build_inference_service,
    build_serving_runtime,
    huggingface_args,
    served_artifact,
    service_name,
    write_triton_repository,
)
from lmforge.serve.model_dir import CONFIG_FILE, ONNX_FP32, STUDENT

log = logging.getLogger("lmforge.serve")

STATUS_FILE = "status.json"
TRITON_DIR = "triton"
ENGINE_FILE = "engine.plan"
QDQ = "int8_qdq"


def _read_json(uri: str) -> dict[str, Any]:
    try:
        value = json.loads(storage.read_bytes(uri))
    except json.JSONDecodeError as exc:
        raise InputDataError(f"{uri}: not valid JSON ({exc.msg}, line {exc.lineno})") from exc
    if not isinstance(value, dict):
        raise InputDataError(f"{uri}: expected a JSON object")
    return value


def _engine_built(release: str, manifest: dict[str, Any]) -> bool:
    if ENGINE not in (manifest.get("artifacts") or {}):
        return False
    status_uri = storage.join(release, ENGINE, STATUS_FILE)
    return storage.is_file(status_uri) and _read_json(status_uri).get("status") == "built"


def _triton_repository(cfg: ServeConfig, release: str, artifact: str, name: str, out: Path, work: Path) -> str:
    """Write the repository into ``out/triton``, copy it to ``<release>/triton``; return that URI."""
    if artifact == ENGINE:
        engine_dir = storage.localize(storage.join(release, ENGINE), work)
        graph = _read_json(str(engine_dir / "build_record.json")).get("graph", NO_PAST_FILE)
        signature = storage.localize(storage.join(release, QDQ, str(graph)), work)
        write_triton_repository(
            out / TRITON_DIR,
            model_name=name,
            model_file=engine_dir / ENGINE_FILE,
            platform="tensorrt_plan",
            cfg=cfg,
            signature_onnx=signature,
        )
    else:
        onnx_dir = storage.localize(storage.join(release, ONNX_FP32), work)
        write_triton_repository(
            out / TRITON_DIR, model_name=name, model_file=onnx_dir / NO_PAST_FILE, platform="onnxruntime_onnx", cfg=cfg
        )
    target = storage.join(release, TRITON_DIR)
    config = storage.join(target, name, "config.pbtxt")
    if storage.is_file(config):
        if storage.read_bytes(config) != (out / TRITON_DIR / name / "config.pbtxt").read_bytes():
            raise InputDataError(f"{target} holds another Triton repository for {name}; releases are never overwritten")
        log.info("%s: Triton repository already in the release", target)
    else:
        storage.copy_tree(str(out / TRITON_DIR), target, last=("config.pbtxt",))
    return target


def _student_context(release: str) -> int:
    """The context ``<release>/student/config.json`` declares; raise if the runtime could not load the model."""
    uri = storage.join(release, STUDENT, CONFIG_FILE)
    if not storage.is_file(uri):
        raise InputDataError(f"{uri}: not found; the huggingface runtime loads the release's {STUDENT}/ directory")
    config = _read_json(uri)
    if not config.get("architectures"):
        raise InputDataError(f"{uri}: no architectures; kserve-huggingfaceserver infers the model's task from them")
    context = max_positions(config)
    if context is None:
        raise InputDataError(f"{uri}: no n_positions or max_position_embeddings; nothing to give --max_model_len")
    return context


def placed(
    cfg: ServeConfig,
    *,
    predictor_image: str = "",
    gpu_node_selector: dict[str, str] | None = None,
    gpu_tolerations: list[dict[str, Any]] | None = None,
) -> ServeConfig:
    """``cfg`` with what the pipeline passes filled in where the serve section leaves it null.

    The serve section wins: ``serve.image``, ``serve.node_selector`` and ``serve.tolerations`` set by the user are
    kept; null ones take the pipeline's predictor image and its GPU pool (``gpu_node_selector``, ``gpu_tolerations``,
    what the GPU steps are placed with).

    Raises:
        ConfigError: a toleration is not a valid :class:`TolerationConfig` (named by its index).
    """
    update: dict[str, Any] = {}
    if cfg.image is None and predictor_image:
        update["image"] = predictor_image
    if cfg.node_selector is None and gpu_node_selector:
        update["node_selector"] = {str(k): str(v) for k, v in gpu_node_selector.items()}
    if cfg.tolerations is None and gpu_tolerations:
        update["tolerations"] = [
            validate_config(TolerationConfig, t, prefix=f"gpu_tolerations[{i}]") for i, t in enumerate(gpu_tolerations)
        ]
    return cfg.model_copy(update=update) if update else cfg


def run(
    cfg: ServeConfig,
    *,
    release: str,
    serving: str | Path,
    predictor_image: str = "",
    gpu_node_selector: dict[str, str] | None = None,
    gpu_tolerations: list[dict[str, Any]] | None = None,
) -> StageResult:
    """Write (and with ``cfg.apply``, apply) the serving objects for ``release`` into ``serving``.

    ``predictor_image``, ``gpu_node_selector`` and ``gpu_tolerations`` fill the serve section's null fields
    (:func:`placed`).
    """
    cfg = placed(
        cfg, predictor_image=predictor_image, gpu_node_selector=gpu_node_selector, gpu_tolerations=gpu_tolerations
    )
    manifest = _read_json(storage.join(release, MANIFEST))
    if manifest.get("kind") != "release":
        raise InputDataError(f"{release}: manifest kind {manifest.get('kind')!r}, expected 'release'")
    model_name, version = str(manifest.get("model_name")), manifest.get("version")
    artifact = served_artifact(manifest, cfg, engine_built=_engine_built(release, manifest))
    name = service_name(cfg, model_name)
    objects = [build_serving_runtime(cfg)] if cfg.resolved_runtime == "lmforge" else []  # checks the image first
    args: list[str] = []
    if cfg.resolved_runtime == "huggingface":
        args = huggingface_args(cfg, model_name=cfg.model_name or model_name, max_model_len=_student_context(release))
    with staged_output(serving) as out, tempfile.TemporaryDirectory(prefix="lmforge-serve-") as work:
        if cfg.resolved_runtime == "triton":
            storage_uri = _triton_repository(cfg, release, artifact, name, out, Path(work))
        else:
            storage_uri = storage.join(release, artifact)
        if objects:
            (out / "servingruntime.yaml").write_text(yaml.safe_dump(objects[0], sort_keys=False), encoding="utf-8")
        isvc = build_inference_service(cfg, storage_uri=storage_uri, model_name=model_name, version=version, args=args)
        objects.append(isvc)
        (out / "inferenceservice.yaml").write_text(yaml.safe_dump(isvc, sort_keys=False), encoding="utf-8")
        applied = apply_and_wait(objects, apply=cfg.apply, timeout_s=cfg.apply_timeout_s)
        local_command = f"lmforge serve {release} --port 8080"
        status = {
            "status": applied.status,
            "reason": applied.reason,
            "url": applied.url,
            "written": applied.written,
            "local_command": local_command,
        }
        (out / STATUS_FILE).write_text(json.dumps(status, indent=2), encoding="utf-8")
        write_manifest(
            out,
            "serving",
            inputs={"release": {"uri": release, "version": version}},
            config=cfg.model_dump(),
            extra={"runtime": cfg.resolved_runtime, "artifact": artifact, "storage_uri": storage_uri},
        )
    log.info("serve %s %s: %s runtime, %s; apply %s", model_name, version, cfg.resolved_runtime, storage_uri, status)
    return StageResult(
        metrics={},
        summary={
            "service": name,
            "runtime": cfg.resolved_runtime,
            "artifact": artifact,
            "storage_uri": storage_uri,
            "apply": status,
            "local_command": local_command,
        },
    )
