"""Run a training stage where its launch configuration says: in this process, under torchrun, or as a job.

A KFP component calls :func:`run_training_stage` instead of the stage's ``run``:

- ``num_nodes == 1`` and ``gpus_per_node <= 1``: the stage runs in this process, exactly as ``lmforge stage``.
- ``num_nodes == 1`` and ``gpus_per_node > 1``: ``torchrun --standalone --nproc_per_node=<GPUs> -m lmforge stage
  ... --result <file>`` runs in this pod, its output streamed into this step's log; rank 0 writes the outputs.
- ``num_nodes > 1``: the job's pods cannot see this step's local artifact paths, so each input is copied to
  ``<staging_uri>/<run id>/<task>/<name>``, the job (:func:`lmforge.launch.launch`) reads and writes there, and
  the outputs are copied back, every file checked against its manifest.

The other side, inside torchrun's workers or the job's pods, is :func:`run_stage_uris` (``lmforge stage ...
--result URI``): ``s3://`` inputs are downloaded once per pod, ``s3://`` outputs are written locally and
uploaded by rank 0 (manifest last), and rank 0 writes the :class:`~lmforge.results.StageResult` as JSON.
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lmforge import storage
from lmforge.artifacts import MANIFEST, PUBLISH_CLAIM, read_manifest, staged_output
from lmforge.config import LaunchConfig, parse_overrides, validate_config
from lmforge.errors import (
    ArtifactConflictError,
    ArtifactIncompleteError,
    ConfigError,
    InputDataError,
    PreflightError,
    StorageError,
)
from lmforge.launch.cancel import CancelRequested, sigterm_raises
from lmforge.launch.client import LaunchCancelled, LaunchError, launch
from lmforge.launch.discovery import check_training_api
from lmforge.launch.manifests import describe_command, single_pod_command, stage_args
from lmforge.results import StageResult
from lmforge.run_context import RUN_ID_ENV, RunContext
from lmforge.scratch import scratch_dir
from lmforge.stages import STAGES, get_stage, resolve_stage_config, run_stage
from lmforge.tracking.stages import tracked_stage

log = logging.getLogger("lmforge.launch")

# Where `lmforge stage` keeps local copies of s3:// inputs and outputs (default: the system temp dir).
WORKDIR_ENV = "LMFORGE_STAGE_WORKDIR"
RESULT_FILE = "result.json"
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")  # = `torchrun`, without relying on PATH


def parse_launch(launch: str | Mapping[str, Any] | None, *, gpus_per_node: int | None = None) -> LaunchConfig:
    """A :class:`LaunchConfig` from a JSON object (dotted keys nest); ``gpus_per_node`` fills in when not set.

    Raises:
        ConfigError: not JSON, not an object, or a field that is unknown or invalid (named as ``launch.<field>``).
    """
    data: Any = launch or {}
    if isinstance(data, str):
        try:
            data = json.loads(data) if data.strip() else {}
        except json.JSONDecodeError as exc:
            raise ConfigError(f"launch: not valid JSON ({exc.msg} at char {exc.pos})") from exc
    if not isinstance(data, Mapping):
        raise ConfigError(f"launch: expected a JSON object of LaunchConfig fields, got {type(data).__name__}")
    fields = parse_overrides(dict(data))
    if gpus_per_node is not None:
        fields.setdefault("gpus_per_node", gpus_per_node)
    return validate_config(LaunchConfig, fields, prefix="launch")


def run_training_stage(
    stage: str,
    cfg: LaunchConfig,
    io: Mapping[str, str],
    *,
    preset: str,
    overrides: str | Mapping[str, Any] | None = None,
    image: str = "",
    run_id: str = "",
    task: str = "",
    staging_uri: str = "",
    api_client: Any = None,
    context: Mapping[str, str] | None = None,
) -> StageResult:
    """Run ``stage`` in this process, under torchrun in this pod, or as a multi-node job, as ``cfg`` says.

    Args:
        stage: Stage name (``lmforge.stages.STAGES``); only a ``distributed`` stage runs under torchrun or as a job.
        cfg: Where and how wide to run.
        io: Local paths of the stage's inputs and outputs (and its string parameters such as ``qa_uri``).
        preset: Config preset; ``overrides``: stage-relative overrides (JSON object or mapping).
        image: Container image of the job's pods (``num_nodes > 1`` only).
        run_id: Pipeline run id; default ``$LMFORGE_RUN_ID``. With ``task`` (default: the stage name) it names
            the job, so a retried step adopts the job its earlier attempt submitted.
        staging_uri: ``s3://`` prefix for the job's inputs and outputs (``num_nodes > 1`` only).
        api_client: Kubernetes API client; default: in-cluster service account, else ``~/.kube/config``.
        context: the run's ``preset``, ``run_id`` and ``pipeline_version`` (:func:`~lmforge.stages.run_stage`).
            With MLflow tracking on, the stage's run is logged where its result is: by rank 0 of torchrun's
            workers, which inherit this process's environment, or here for a multi-node job, whose pods do not
            (:mod:`lmforge.tracking.stages`).

    Returns:
        The stage's result, read back from the workers or the job when it ran elsewhere; its summary gains
        ``launch`` (how it ran).

    Raises:
        ConfigError: bad overrides, or a multi-node launch without an s3:// staging URI, image or run id.
        PreflightError: (multi-node) the cluster does not serve the job kind; nothing was staged or submitted.
        InputDataError: (multi-node) an output path is not empty, or an input has no manifest.
        LaunchError: torchrun or the job failed (with the last lines of its log); no output was written.
    """
    spec = get_stage(stage)
    stage_cfg = resolve_stage_config(stage, preset, overrides)  # a bad override fails here, before any launch
    flat = _flat_overrides(overrides)
    if not spec.distributed:
        if cfg.num_nodes > 1 or cfg.gpus_per_node > 1:
            log.warning(
                "%s runs in one process (only %s run distributed): running it here on one device, not on "
                "%d node(s) x %d GPU(s)",
                stage,
                ", ".join(name for name, s in STAGES.items() if s.distributed),
                cfg.num_nodes,
                cfg.gpus_per_node,
            )
        return _in_process(stage, stage_cfg, io, context)
    if cfg.num_nodes > 1:
        with tracked_stage(spec, stage_cfg, io, context) as tracked:
            tracked.result = _as_job(
                stage, cfg, io, flat, preset, image, run_id, task or stage, staging_uri, api_client
            )
        return tracked.result
    if cfg.gpus_per_node > 1:
        return _in_pod(stage, cfg, io, flat, preset)
    return _in_process(stage, stage_cfg, io, context)


def _flat_overrides(overrides: str | Mapping[str, Any] | None) -> dict[str, Any]:
    if isinstance(overrides, str):
        return json.loads(overrides) if overrides.strip() else {}  # already validated by resolve_stage_config
    return dict(overrides or {})


def _in_process(stage: str, stage_cfg: Any, io: Mapping[str, str], context: Mapping[str, str] | None) -> StageResult:
    result = run_stage(stage, stage_cfg, dict(io), context=context)
    result.summary["launch"] = {"mode": "in-process"}
    return result


def _in_pod(
    stage: str, cfg: LaunchConfig, io: Mapping[str, str], overrides: dict[str, Any], preset: str
) -> StageResult:
    """torchrun with one process per GPU of this pod; the result comes back through a local JSON file."""
    gpus_per_node = cfg.gpus_per_node
    with tempfile.TemporaryDirectory(prefix=f"lmforge-{stage}-torchrun-") as tmp:
        result_path = str(Path(tmp, RESULT_FILE))
        args = [*stage_args(stage, io, preset=preset, overrides=overrides), "--result", result_path]
        command = single_pod_command(gpus_per_node, args, launcher=TORCHRUN)
        run_streaming(command, what=f"{stage}: torchrun with {gpus_per_node} processes", tail_lines=cfg.log_tail_lines)
        if not Path(result_path).is_file():
            raise LaunchError(f"{stage}: torchrun exited with code 0 but rank 0 wrote no result ({result_path})")
        result = read_result(result_path)
    result.summary["launch"] = {"mode": "torchrun", "nproc_per_node": gpus_per_node}
    return result


def run_streaming(command: Sequence[str], *, what: str, tail_lines: int = 50) -> None:
    """Run ``command``, logging each line of its output; on failure raise :class:`LaunchError` with the last lines.

    SIGTERM (the run was cancelled) or Ctrl-C stops the command (SIGTERM, then SIGKILL after 30 s) before
    :class:`LaunchCancelled` / ``KeyboardInterrupt`` propagates.
    """
    log.info("%s: %s", what, describe_command(command))
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", env=env
    )
    with sigterm_raises():
        try:
            for raw in proc.stdout or ():
                line = raw.rstrip("\n")
                tail.append(line)
                log.info("[%s] %s", what.partition(":")[0], line)
            code = proc.wait()
        except (CancelRequested, KeyboardInterrupt) as exc:
            log.warning("%s: %s; stopping it", what, str(exc) or type(exc).__name__)
            _stop(proc)
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise LaunchCancelled(f"{what}: cancelled by {exc}; stopped the processes") from None
        except BaseException:
            _stop(proc)  # never leave the workers running behind an error of our own
            raise
        finally:
            if proc.stdout is not None:
                proc.stdout.close()
    if code != 0:
        raise LaunchError("\n".join([f"{what}: exited with code {code}", f"--- last {len(tail)} lines ---", *tail]))


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()  # torchrun forwards SIGTERM to its workers
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _as_job(
    stage: str,
    cfg: LaunchConfig,
    io: Mapping[str, str],
    overrides: dict[str, Any],
    preset: str,
    image: str,
    run_id: str,
    task: str,
    staging_uri: str,
    api_client: Any,
) -> StageResult:
    """Stage inputs to S3, run the job there, copy the outputs back and read its result."""
    spec = get_stage(stage)
    check_staging_uri(staging_uri, cfg.num_nodes)
    run_id = job_run_id(run_id)
    if not image:
        raise ConfigError("job image: launch.num_nodes > 1 needs the container image of the job's pods")
    cfg = with_run_env(cfg, run_id)
    outputs = _artifact_names(spec.outputs)
    refuse_filled_outputs(io, outputs)
    verdict = check_training_api(cfg, api_client)
    if verdict != "ok":
        raise PreflightError(f"launch: {verdict}")

    prefix = storage.join(staging_uri, run_id, task)
    remote = stage_io(stage, io, prefix, outputs=outputs, inputs=_artifact_names(spec.inputs))
    result_uri = storage.join(prefix, RESULT_FILE)
    args = [*stage_args(stage, remote, preset=preset, overrides=overrides), "--result", result_uri]

    launched = launch(cfg, args, image=image, run_id=run_id, task=task, api_client=api_client)

    if not storage.is_file(result_uri):
        raise LaunchError(f"{launched.kind} {launched.name} succeeded but wrote no result at {result_uri}")
    result = read_result(result_uri)
    fetched = fetch_outputs(stage, io, remote, outputs)
    result.summary = _swap_paths(result.summary, fetched)
    result.summary["launch"] = {
        "mode": "job",
        "kind": launched.kind,
        "job": launched.name,
        "namespace": launched.namespace,
        "adopted": launched.adopted,
        "num_nodes": cfg.num_nodes,
        "staging": prefix,
    }
    return result


def check_staging_uri(staging_uri: str, num_nodes: int) -> None:
    """Refuse a staging URI that is not ``s3://bucket[/prefix]``: a job's pods reach its artifacts only there."""
    if not storage.is_s3(staging_uri) or not staging_uri[len(storage.S3_SCHEME) :].strip("/"):
        raise ConfigError(
            f"staging_uri: launch.num_nodes={num_nodes} needs an s3://bucket/prefix the job's pods can reach "
            f"to stage inputs and outputs, got {staging_uri!r}"
        )


def job_run_id(run_id: str) -> str:
    """The pipeline run id that names the job: ``run_id``, else ``$LMFORGE_RUN_ID``; refused when unresolved."""
    run_id = run_id or RunContext.from_env().run_id
    if not run_id or "{{" in run_id:
        raise ConfigError(
            f"run id: launch.num_nodes > 1 names the job after the pipeline run, but the run id is "
            f"{run_id or 'empty'!r}; set ${RUN_ID_ENV} (the lmforge pipeline maps it from the pod label "
            "pipeline/runid) or pass run_id"
        )
    return run_id


def with_run_env(cfg: LaunchConfig, run_id: str) -> LaunchConfig:
    """``cfg`` whose pods also get the run id and, when set here, the run root (``cfg.env`` wins on a clash)."""
    # The pods do not inherit this step's environment: the run id and root fill a templated checkpoint.dir there.
    run_env = RunContext(run_id=run_id, run_root=RunContext.from_env().run_root).to_env()
    return cfg.model_copy(update={"env": run_env | cfg.env})


def refuse_filled_outputs(io: Mapping[str, str], outputs: set[str]) -> None:
    """Raise :class:`InputDataError` when a local output path already holds a file or a non-empty directory."""
    for name in outputs:
        local = Path(io[name]) if io.get(name) else None
        if local is not None and local.exists() and (local.is_file() or any(local.iterdir())):
            raise InputDataError(f"output {local} already exists and is not empty; refusing to overwrite it")


def stage_io(stage: str, io: Mapping[str, str], prefix: str, *, outputs: set[str], inputs: set[str]) -> dict[str, str]:
    """The job's view of ``io``: outputs and local artifact inputs under ``prefix`` (inputs copied there now).

    Parameters and inputs already on S3 pass through unchanged.
    """
    remote: dict[str, str] = {}
    for name, value in io.items():
        if name in outputs:
            remote[name] = storage.join(prefix, name)
        elif name in inputs and not storage.is_s3(value):
            remote[name] = storage.join(prefix, name)
            copied = publish_artifact(value, remote[name])
            log.info("%s: staged input %s %s %s", stage, name, "->" if copied else "already at", remote[name])
        else:
            remote[name] = value
    return remote


def fetch_outputs(stage: str, io: Mapping[str, str], remote: Mapping[str, str], outputs: set[str]) -> dict[str, str]:
    """Copy each requested output from the job's staging back to its local path, verified.

    Returns:
        ``{staged URI: local path}`` of the outputs copied.
    """
    fetched: dict[str, str] = {}
    for name in outputs:
        if io.get(name):
            fetch_artifact(remote[name], io[name])
            log.info("%s: output %s <- %s (verified)", stage, io[name], remote[name])
            fetched[remote[name]] = io[name]
    return fetched


def _artifact_names(ports: Sequence[Any]) -> set[str]:
    """The artifact (directory) ports; parameters such as ``qa_uri`` are read by the stage itself, never staged."""
    return {port.name for port in ports if port.is_artifact}


# --- inside the workers / the job's pods: `lmforge stage ... --result URI` -------------------------------------------


def run_stage_uris(
    stage: str,
    stage_cfg: Any,
    io: Mapping[str, str],
    *,
    result_uri: str | None = None,
    workdir: str | Path | None = None,
    context: Mapping[str, str] | None = None,
) -> StageResult:
    """Run one stage whose artifact inputs and outputs may be ``s3://`` prefixes (what ``lmforge stage`` runs).

    ``s3://`` inputs are downloaded (verified against their manifest) once per machine into ``workdir``
    (default ``$LMFORGE_STAGE_WORKDIR`` or the temp dir), shared by the ranks there; ``s3://`` outputs are
    written to a local scratch directory and uploaded by rank 0, manifest last, their manifest naming the
    S3 inputs rather than the local copies. Rank 0 (``RANK`` unset or 0) writes the result to ``result_uri``.
    ``context`` (the run's ``preset`` and ``run_id``) reaches the stages that take it.
    """
    spec = get_stage(stage)
    outputs, inputs = _artifact_names(spec.outputs), _artifact_names(spec.inputs)
    root = Path(workdir or os.environ.get(WORKDIR_ENV) or tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    main = int(os.environ.get("RANK", "0")) == 0
    with scratch_dir(f"lmforge-stage-{stage}-", root) as scratch:
        local: dict[str, Any] = dict(io)
        uploads: dict[str, str] = {}
        localized: dict[str, str] = {}
        for name, value in io.items():
            if name in outputs and storage.is_s3(value):
                if storage.is_file(storage.join(value, MANIFEST)):
                    raise InputDataError(f"output {value} already holds a complete artifact; refusing to overwrite it")
                local[name] = str(Path(scratch, name))
                uploads[name] = value
            elif name in inputs:
                uris = value.split(",") if spec.port(name).many and isinstance(value, str) else value
                copies = [_local_copy(uri, root, localized) for uri in ([uris] if isinstance(uris, str) else uris)]
                local[name] = copies if spec.port(name).many else copies[0]
        result = run_stage(stage, stage_cfg, local, context=context)
        if main:
            for name, uri in uploads.items():
                _name_s3_inputs(Path(local[name]), localized)
                publish_artifact(local[name], uri)
                log.info("%s: uploaded output %s -> %s", stage, name, uri)
            result.summary = _swap_paths(result.summary, {local[n]: uri for n, uri in uploads.items()})
    if main and result_uri:
        write_result(result, result_uri)
    return result


def _local_copy(uri: str, root: Path, localized: dict[str, str]) -> str:
    """A local path for artifact ``uri`` (downloaded when it is on S3), noting the S3 source for lineage."""
    if not storage.is_s3(uri):
        return uri
    path = str(localize_artifact(uri, root / "lmforge-inputs"))
    localized[path] = uri
    return path


def localize_artifact(uri: str, cache_root: Path) -> Path:
    """A verified local copy of the artifact at ``uri``, downloaded once per machine (a file lock serializes ranks)."""
    raw = _remote_manifest(uri)
    key = hashlib.sha256(uri.encode() + b"\0" + raw).hexdigest()[:16]
    cache_root.mkdir(parents=True, exist_ok=True)
    target = cache_root / key
    with open(cache_root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / MANIFEST).is_file():
            fetch_artifact(uri, target, manifest=raw)
            log.info("downloaded %s -> %s", uri, target)
    return target


def fetch_artifact(uri: str, local: str | Path, *, manifest: bytes | None = None) -> dict[str, Any]:
    """Copy the files ``uri``'s manifest lists (then the manifest) into ``local`` and verify every sha256.

    ``local`` must be absent or empty; nothing is left there unless the whole copy verified.
    """
    raw = manifest if manifest is not None else _remote_manifest(uri)
    where = storage.join(uri, MANIFEST)
    try:
        listed = json.loads(raw)["files"]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise ArtifactIncompleteError(f"{where}: not an lmforge manifest ({exc})") from exc
    if not isinstance(listed, dict):
        raise ArtifactIncompleteError(f"{where}: not an lmforge manifest ('files' is not an object)")
    with staged_output(local) as scratch:
        targets = {name: storage.safe_join(scratch, name, where=where) for name in sorted(listed)}  # all, first
        for name, target in targets.items():
            storage.download_file(storage.join(uri, name), target)
        (scratch / MANIFEST).write_bytes(raw)
        try:
            return read_manifest(scratch, verify=True)
        except ArtifactIncompleteError as exc:
            raise ArtifactIncompleteError(str(exc).replace(str(scratch), uri)) from exc


def publish_artifact(local: str | Path, uri: str) -> bool:
    """Copy a complete local artifact to ``uri``, manifest last; False when the same artifact is already there.

    Concurrent publishers to one prefix cannot tear it: each first creates ``uri/.publishing.json``
    (naming its manifest's sha256) with a conditional create (S3 ``If-None-Match: *``, locally a hard
    link), and only the one that created it, or a publisher of the very same manifest (a retry: same
    bytes), writes files; the manifest itself is created conditionally too, last. The claim is kept
    after success, so a later publisher of a different artifact is refused even while the manifest is
    being read. A claim left by a publisher that died is removed by ``lmforge registry gc``.

    Raises:
        ArtifactIncompleteError: ``local`` has no manifest.
        ArtifactConflictError: ``uri`` holds, or is being given, a different artifact (never overwritten).
    """
    read_manifest(local)
    mine = Path(local, MANIFEST).read_bytes()
    digest = hashlib.sha256(mine).hexdigest()
    target = storage.join(uri, MANIFEST)
    if _same_complete(target, mine, uri):
        return False
    claim_uri = storage.join(uri, PUBLISH_CLAIM)
    claim = {"manifest_sha256": digest, "claim_id": uuid.uuid4().hex, "claimed_at": _utc_now(), "host": os.uname()[1]}
    if not storage.create_if_absent(claim_uri, json.dumps(claim).encode()):
        holder = _read_claim(claim_uri)
        if holder.get("manifest_sha256") != digest:
            if _same_complete(target, mine, uri):
                return False
            raise ArtifactConflictError(
                f"{uri}: another publisher claimed it for a different artifact ({claim_uri}, claimed at "
                f"{holder.get('claimed_at', '?')} on {holder.get('host', '?')}); refusing to write into it. If that "
                "publisher died, `lmforge registry gc <a prefix above it>` removes the stale claim"
            )
        log.info("%s: claimed by a publisher of the same artifact (a retry); copying again", uri)
    for name in storage.list_files(str(local)):
        if name != MANIFEST:
            storage.upload_file(Path(local, name), storage.join(uri, name))
    if not storage.create_if_absent(target, mine):
        if storage.read_bytes(target) == mine:
            return False  # a publisher of the same artifact finished first
        raise ArtifactConflictError(f"{target} appeared during publishing although {claim_uri} was ours")
    return True


def _same_complete(target: str, mine: bytes, uri: str) -> bool:
    """True when ``target`` exists with exactly ``mine``; a different manifest there is a conflict."""
    if not storage.is_file(target):
        return False
    if storage.read_bytes(target) == mine:
        return True
    raise ArtifactConflictError(f"{uri} already holds a different complete artifact; refusing to overwrite it")


def _read_claim(claim_uri: str) -> dict[str, Any]:
    try:
        value = json.loads(storage.read_bytes(claim_uri))
    except (ValueError, StorageError):
        return {}
    return value if isinstance(value, dict) else {}


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _remote_manifest(uri: str) -> bytes:
    try:
        return storage.read_bytes(storage.join(uri, MANIFEST))
    except StorageError as exc:
        raise ArtifactIncompleteError(
            f"{uri}: no readable {MANIFEST}; the artifact is incomplete or not an lmforge output ({exc})"
        ) from exc


def _name_s3_inputs(output: Path, localized: Mapping[str, str]) -> None:
    """Lineage: the output's manifest names the S3 inputs it was made from, not this machine's copies."""
    path = output / MANIFEST
    if not localized or not path.is_file():
        return
    manifest = json.loads(path.read_text(encoding="utf-8"))
    changed = False
    for record in manifest.get("inputs", {}).values():
        if isinstance(record, dict) and record.get("uri") in localized:
            record["uri"] = localized[record["uri"]]
            changed = True
    if changed:
        storage.write_bytes(str(path), json.dumps(manifest, indent=2, sort_keys=True).encode())


def _swap_paths(summary: Mapping[str, Any], mapping: Mapping[str, str]) -> dict[str, Any]:
    return {k: mapping.get(v, v) if isinstance(v, str) else v for k, v in summary.items()}


def write_result(result: StageResult, uri: str) -> None:
    """The stage result as JSON (metrics, summary, html) at a local path or ``s3://`` URI, written atomically."""
    data = {"metrics": result.metrics, "summary": result.summary, "html": result.html}
    storage.write_bytes(uri, json.dumps(data, default=str).encode())


def read_result(uri: str) -> StageResult:
    """The :class:`StageResult` :func:`write_result` wrote."""
    try:
        data = json.loads(storage.read_bytes(uri))
        return StageResult(metrics=dict(data["metrics"]), html=data.get("html"), summary=dict(data["summary"]))
    except (ValueError, TypeError, KeyError) as exc:
        raise LaunchError(f"{uri}: not a stage result written by `lmforge stage --result` ({exc})") from exc
