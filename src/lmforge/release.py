"""The ``promote`` stage: copy gated artifacts into an immutable, versioned release; read the registry.

Layout under ``release_root`` (a local path or ``s3://bucket/prefix``)::

    models/<name>/<version>/.promotion.json    the claim on the version, written first
    models/<name>/<version>/<artifact>/...     one folder per artifact, its own manifest.json last
    models/<name>/<version>/evaluation/...     the evaluation report and results
    models/<name>/<version>/manifest.json      the release manifest (lineage), written last
    models/<name>/latest.json                  {"version", "manifest_uri", "created_at"}, after it

Protocol. A release whose ``manifest.json`` exists is complete. A promotion first *claims* its version
by creating ``.promotion.json`` with a conditional create (S3 ``PUT`` with ``If-None-Match: *``; locally
a hard link, which fails if the name exists): of two concurrent promotions of one version exactly one
gets the claim, the other fails with :class:`ReleaseExistsError` before writing anything. Anything
already at the target (a complete release, a claim, the remains of an interrupted promotion) also
refuses the promotion: a version is never overwritten. The release manifest is created the same
conditional way, after every artifact. ``latest.json`` is then moved by compare-and-swap (S3 ``If-Match``
on the ETag read, ``If-None-Match: *`` when absent; locally under a file lock), and only forward: to a
release whose ``(created_at, version)`` is greater than the one it names, so concurrent promotions of
different versions all land and ``latest.json`` ends at the newest complete one, whatever the order in
which their writes interleave. Readers (:func:`latest_release`) never report a release without its
manifest: a ``latest.json`` naming one is ignored in favour of the newest complete release.

Gate baseline. ``evaluate`` records in ``results.json`` which production release its gate compared
with (``production``: version and :func:`release_fingerprint`, or ``status: none``). ``promote`` refuses
an evaluation whose baseline is no longer the latest release (:class:`GateBaselineMovedError`): before
claiming the version, and again inside the compare-and-swap of ``latest.json``, so of two runs gated
against the same release only the first to promote becomes latest; the other must be evaluated again
against it. (If the second one's baseline moves while it is copying, its release is complete but
``latest.json`` is left alone and the promotion fails saying so.)

Unchanged candidates. A scheduled run on unchanged data re-evaluates (its baseline moved) and passes the
gate with the very models production serves. ``promote`` then publishes nothing: when every artifact it
would publish has the same kind, content (:func:`~lmforge.artifacts.fingerprint`, the files' sha256) and
input fingerprints as the production release's, and none is missing or extra, it returns that release
(summary ``status: unchanged``) without claiming a version. The check is made against production at the
time of promotion: two concurrent promotions of one new model both publish.

MLflow. With tracking on, the ``promote`` stage (:func:`run`) also registers the release as an MLflow model
version and moves the alias ``production`` by the same rule (:mod:`lmforge.tracking.promotion`). When the gate's
baseline came from that alias (``evaluate.production_source: mlflow``), the alias is production: it is re-checked
instead of ``latest.json``, which then only moves forward.

Conditional writes need an S3 server that implements them (AWS S3, MinIO, SeaweedFS ≥ 3.8x; the test
server checks it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from lmforge import __version__, storage
from lmforge.artifacts import MANIFEST, PUBLISH_CLAIM, fingerprint, read_json_file, read_manifest
from lmforge.errors import (
    ConfigError,
    GateBaselineMovedError,
    InputDataError,
    LmforgeError,
    ReleaseExistsError,
    StorageError,
)
from lmforge.export.accuracy_gate import gate_result
from lmforge.results import StageResult
from lmforge.tracking.promotion import check_alias_baseline, from_alias, register_promoted

log = logging.getLogger("lmforge.promote")

VERSION_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
LATEST = "latest.json"
CLAIM = ".promotion.json"
EVALUATION = "evaluation"
RESULTS_FILE = "results.json"
_CAS_ATTEMPTS = 20


def default_version() -> str:
    """A version from the current UTC time: ``vYYYYMMDD-HHMMSS``."""
    return time.strftime("v%Y%m%d-%H%M%S", time.gmtime())


def _check_name(kind: str, value: str) -> None:
    if not VERSION_PATTERN.fullmatch(value or ""):
        raise ConfigError(
            f"invalid {kind} {value!r}: use letters, digits, '.', '_' or '-', starting with a letter or digit"
        )


def _occupied(uri: str) -> bool:
    """True when anything exists at ``uri``.

    On S3 ``storage.exists`` matches any key starting with the prefix (``.../v1`` also matches
    ``.../v10/...``), so a release prefix is confirmed by listing below ``<uri>/``.
    """
    if not storage.exists(uri):
        return False
    return not storage.is_s3(uri) or bool(storage.list_files(uri))


def _read_results(evaluation_dir: Path) -> dict[str, Any]:
    path = evaluation_dir / RESULTS_FILE
    if not path.is_file():
        raise InputDataError(f"evaluation directory {evaluation_dir}: no {RESULTS_FILE}")
    return read_json_file(path)


def read_tagged(uri: str) -> tuple[bytes | None, str | None]:
    """Content and S3 ETag of ``uri`` (``(None, None)`` when absent; the tag is ``None`` locally)."""
    if not storage.is_s3(uri):
        path = Path(uri)
        return (path.read_bytes(), None) if path.is_file() else (None, None)
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = storage.split_s3(uri)
    try:
        resp = storage.s3_client().get_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
            return None, None
        raise StorageError(f"get {uri}: {exc}") from exc
    except BotoCoreError as exc:
        raise StorageError(f"get {uri}: {exc}") from exc
    return resp["Body"].read(), resp["ETag"]


def swap_if_unchanged(uri: str, data: bytes, etag: str | None, existed: bool) -> bool:
    """Write ``uri`` only if it is unchanged since read (S3 ``If-Match`` / ``If-None-Match``)."""
    if not storage.is_s3(uri):
        storage.write_bytes(uri, data)  # the caller holds the local lock
        return True
    if not existed:
        return storage.create_if_absent(uri, data)
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = storage.split_s3(uri)
    try:
        storage.s3_client().put_object(Bucket=bucket, Key=key, Body=data, IfMatch=etag)
    except ClientError as exc:
        if storage.is_precondition_failure(exc):
            return False
        raise StorageError(f"conditional put {uri}: {exc}") from exc
    except BotoCoreError as exc:
        raise StorageError(f"conditional put {uri}: {exc}") from exc
    return True


@contextlib.contextmanager
def _local_lock(model_root: str) -> Iterator[None]:
    """An exclusive lock for the read-decide-write of a local ``latest.json`` (no-op on S3)."""
    if storage.is_s3(model_root):
        yield
        return
    import fcntl

    Path(model_root).mkdir(parents=True, exist_ok=True)
    with open(Path(model_root, ".latest.lock"), "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _order(entry: Mapping[str, Any]) -> tuple[str, str]:
    """Release order: completion time, then version (ties within a second)."""
    return str(entry.get("created_at") or ""), str(entry.get("version") or "")


def _parse_json(data: bytes, uri: str) -> dict[str, Any] | None:
    try:
        value = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        log.warning("%s: not valid JSON; ignored", uri)
        return None
    return value if isinstance(value, dict) else None


def update_latest(
    model_root: str, entry: Mapping[str, Any], *, baseline: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Point ``latest.json`` at ``entry`` unless it already names a newer release; returns what it names.

    Compare-and-swap: read (with ETag), decide, write only if unchanged, else read again. With
    ``baseline`` (the ``production`` record of the evaluation behind ``entry``), the swap happens only
    while the production release is still that baseline.

    Raises:
        GateBaselineMovedError: ``baseline`` is given and production is another release now.
    """
    uri = storage.join(model_root, LATEST)
    data = json.dumps(dict(entry), indent=2).encode()
    with _local_lock(model_root):
        for _ in range(_CAS_ATTEMPTS):
            raw, etag = read_tagged(uri)
            current = _parse_json(raw, uri) if raw is not None else None
            if baseline is not None:
                now = _identity(_effective_latest(model_root, current, exclude=str(entry.get("version"))))
                if now != baseline_identity(baseline):
                    raise GateBaselineMovedError(
                        f"release {entry.get('version')} is complete at {entry.get('manifest_uri')} but latest.json "
                        f"was not moved to it: {_moved(baseline, now)}. Evaluate it again against the current "
                        "production release and promote a new version if it passes"
                    )
            if current is not None and _order(current) >= _order(entry) and _complete(current):
                log.info("latest.json stays at %s (newer than %s)", current.get("version"), entry.get("version"))
                return current
            if swap_if_unchanged(uri, data, etag, existed=raw is not None):
                return dict(entry)
            time.sleep(0.05)
    raise StorageError(f"{uri}: changed concurrently {_CAS_ATTEMPTS} times in a row; latest.json not updated")


def _complete(latest: Mapping[str, Any]) -> bool:
    """True when the release ``latest`` names has its manifest, of kind release, for that version."""
    uri = latest.get("manifest_uri")
    if not isinstance(uri, str) or not storage.is_file(uri):
        return False
    manifest = _parse_json(storage.read_bytes(uri), uri)
    return bool(manifest) and manifest.get("kind") == "release" and manifest.get("version") == latest.get("version")


def release_fingerprint(manifest: Mapping[str, Any]) -> str:
    """sha256 of a release manifest's canonical JSON: identifies one release exactly (lineage, metrics, time)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_uri"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def baseline_identity(production: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(version, fingerprint)`` of a recorded gate baseline; ``None`` when it says there was no release."""
    if production.get("status") == "none":
        return None
    return str(production.get("version")), str(production.get("fingerprint"))


def _identity(release: Mapping[str, Any] | None) -> tuple[str, str] | None:
    return None if release is None else (str(release.get("version")), release_fingerprint(release))


def _moved(baseline: Mapping[str, Any], now: tuple[str, str] | None) -> str:
    was = baseline_identity(baseline)
    before = f"production {was[0]} (fingerprint {was[1][:12]})" if was else "no production release"
    after = f"{now[0]} (fingerprint {now[1][:12]})" if now else "no complete release"
    return f"the evaluation's gate compared it with {before}, but the latest release is now {after}"


def _effective_latest(model_root: str, latest: Mapping[str, Any] | None, *, exclude: str) -> dict[str, Any] | None:
    """The release a reader takes as latest, given ``latest.json``'s content; ``exclude`` (the release being
    promoted, already complete) does not count as the fall-back newest release."""
    if latest is not None and _complete(latest):
        return _parse_json(storage.read_bytes(latest["manifest_uri"]), latest["manifest_uri"])
    others = [r for r in _releases_under(model_root) if r.get("version") != exclude]
    return others[-1] if others else None


def list_releases(release_root: str, model_name: str) -> list[dict[str, Any]]:
    """Manifests of the complete releases of ``model_name`` (those with ``manifest.json``), oldest first."""
    return _releases_under(storage.join(release_root, "models", model_name))


def _releases_under(model_root: str) -> list[dict[str, Any]]:
    if not storage.exists(model_root):
        return []
    releases = []
    for name in storage.list_files(model_root):
        version, _, rest = name.partition("/")
        if rest != MANIFEST:
            continue
        uri = storage.join(model_root, version, MANIFEST)
        manifest = _parse_json(storage.read_bytes(uri), uri)
        if manifest and manifest.get("kind") == "release" and manifest.get("version") == version:
            releases.append({**manifest, "manifest_uri": uri})
    return sorted(releases, key=_order)


def latest_release(release_root: str, model_name: str) -> dict[str, Any] | None:
    """The current production release's manifest (plus ``manifest_uri``), or ``None`` when there is none.

    ``latest.json`` decides; if it is missing, unreadable or names a release without a manifest, the
    newest complete release is returned instead (with a warning): an incomplete release is never latest.
    """
    model_root = storage.join(release_root, "models", model_name)
    uri = storage.join(model_root, LATEST)
    raw, _ = read_tagged(uri)
    latest = _parse_json(raw, uri) if raw is not None else None
    if latest is not None and _complete(latest):
        manifest = _parse_json(storage.read_bytes(latest["manifest_uri"]), latest["manifest_uri"]) or {}
        return {**manifest, "manifest_uri": latest["manifest_uri"]}
    releases = list_releases(release_root, model_name)
    if latest is not None:
        log.warning(
            "%s names %s, which has no complete release manifest; using the newest complete release (%s)",
            uri,
            latest.get("version"),
            releases[-1]["version"] if releases else "none",
        )
    return releases[-1] if releases else None


def production_summary(release_root: str | None, model_name: str) -> dict[str, Any]:
    """What the gate compares against: the latest release's version and evaluation metrics.

    ``{"status": "none", "reason": ...}`` when there is no registry or no release yet, else
    ``{"status": "found", "version", "manifest_uri", "fingerprint", "created_at", "metrics"}``. ``evaluate``
    stores it in ``results.json`` as the gate's baseline; ``promote`` re-checks it.
    """
    if not release_root:
        return {"status": "none", "reason": "no release registry given"}
    release = latest_release(release_root, model_name)
    if release is None:
        return {"status": "none", "reason": f"no release of {model_name!r} in {release_root} yet"}
    return {
        "status": "found",
        "version": release.get("version"),
        "manifest_uri": release.get("manifest_uri"),
        "fingerprint": release_fingerprint(release),
        "created_at": release.get("created_at"),
        "metrics": dict((release.get("evaluation") or {}).get("metrics") or {}),
    }


def production_baseline(release_root: str | None, model_name: str, source: str = "registry") -> dict[str, Any]:
    """The gate's baseline from ``source`` (``evaluate.production_source``), in :func:`production_summary`'s shape.

    ``registry``: the release root's ``latest.json``; ``mlflow``: the model version the MLflow alias ``production``
    of the registered model ``model_name`` names (:func:`lmforge.tracking.production_baseline_from_registry`,
    which raises :class:`~lmforge.errors.TrackingError` when it cannot be read).
    """
    if source != "mlflow":
        return production_summary(release_root, model_name)
    if not model_name:
        return {"status": "none", "reason": "no model name given", "source": "mlflow"}
    from lmforge.tracking import production_baseline_from_registry

    return {**production_baseline_from_registry(model_name), "source": "mlflow"}  # also when there is none yet


def production_fingerprint(release_root: str | None, model_name: str, source: str = "registry") -> str:
    """sha256 of :func:`production_baseline`: changes whenever the release the gate compares against changes.

    ``preflight`` passes it to ``evaluate`` as a parameter, so a KFP cache key holds the production baseline
    and a scheduled run re-evaluates after a new release instead of reusing a gate decided against the old one.
    """
    summary = production_baseline(release_root, model_name, source)
    return hashlib.sha256(json.dumps(summary, sort_keys=True, default=str).encode()).hexdigest()


def promote(
    *,
    model_name: str,
    release_root: str,
    version: str,
    artifacts: Mapping[str, str | Path],
    evaluation_dir: str | Path,
    run_id: str | None = None,
    require_passed: bool = True,
) -> StageResult:
    """Publish ``artifacts`` and the evaluation as release ``version`` of ``model_name``.

    Args:
        model_name: the release name (``models/<model_name>/`` under ``release_root``).
        release_root: local directory or ``s3://`` URI holding ``models/``.
        version: release version (``default_version()`` gives a timestamp one).
        artifacts: artifact directories by release folder name; each must carry a manifest.
        evaluation_dir: output of the ``evaluate`` stage (manifest + ``results.json``).
        run_id: pipeline run that produced the release, recorded in the manifest.
        require_passed: refuse an evaluation whose gate failed (the pipeline also guards this).

    Returns:
        ``summary["status"]``: ``published`` (``release_uri`` is the new release), or ``unchanged`` when production
        already serves exactly these artifacts (``release_uri``/``version`` are production's; nothing is written).

    Raises:
        ConfigError: bad version or artifact name.
        ArtifactIncompleteError / InputDataError: an input without manifest, or a failed gate.
        ReleaseExistsError: something already exists at the target.
    """
    _check_name("version", version)
    _check_name("model name", model_name)
    for name in artifacts:
        _check_name("artifact name", name)
        if name in (MANIFEST, EVALUATION):
            raise ConfigError(f"artifact name {name!r} is reserved in a release")
    if not artifacts:
        raise InputDataError("promote: no artifacts given")

    evaluation_dir = Path(evaluation_dir)
    eval_manifest = read_manifest(evaluation_dir, verify=True)
    if eval_manifest.get("kind") != "evaluation":
        raise InputDataError(f"{evaluation_dir}: manifest kind {eval_manifest.get('kind')!r}, expected 'evaluation'")
    results = _read_results(evaluation_dir)
    if require_passed and not results.get("passed"):
        failed = [c["name"] for c in results.get("gate", {}).get("checks", []) if not c.get("passed")]
        raise InputDataError(
            f"evaluation {evaluation_dir} did not pass the gate (failed: {', '.join(failed) or 'unknown'}); "
            "refusing to promote"
        )
    sources = {name: Path(path) for name, path in artifacts.items()}
    manifests = {name: read_manifest(path, verify=True) for name, path in sources.items()}
    withheld = {name: gate["reason"] for name, path in sources.items() if not (gate := gate_result(path))["accepted"]}
    for name, reason in withheld.items():
        log.warning("withholding %s from the release: its accuracy gate %s", name, reason)
    sources = {name: path for name, path in sources.items() if name not in withheld}
    if not sources:
        raise InputDataError(f"promote: every artifact failed its accuracy gate ({', '.join(withheld)})")

    model_root = storage.join(release_root, "models", model_name)
    production = latest_release(release_root, model_name)
    if production is not None and _serves(production, {name: manifests[name] for name in sources}):
        log.info(
            "%s %s already serves these artifacts (same files and inputs); nothing published",
            model_name,
            production["version"],
        )
        return StageResult(
            metrics={},
            summary={
                "status": "unchanged",
                "release_uri": storage.join(model_root, production["version"]),
                "version": production["version"],
                "manifest_uri": production["manifest_uri"],
                "latest_version": production["version"],
            },
        )
    target = storage.join(model_root, version)
    release_manifest_uri = storage.join(target, MANIFEST)
    baseline = results.get("production")
    if from_alias(baseline):  # the MLflow alias is production: promote's caller checks it, latest.json only follows
        baseline = None
    elif isinstance(baseline, Mapping):
        now = _identity(production)
        if now != baseline_identity(baseline):
            raise GateBaselineMovedError(
                f"evaluation {evaluation_dir} is stale: {_moved(baseline, now)}. Evaluate again against the "
                "current production release before promoting"
            )
    else:
        baseline = None
        log.warning(
            "%s records no gate baseline (production); latest.json is moved without re-checking it", evaluation_dir
        )
    if _occupied(target):
        raise ReleaseExistsError(
            f"release {target} already exists as {_state(target)}; releases are never overwritten, choose a new version"
        )
    claim = {"run_id": run_id, "claim_id": uuid.uuid4().hex, "claimed_at": _now()}
    if not storage.create_if_absent(storage.join(target, CLAIM), json.dumps(claim).encode()):
        raise ReleaseExistsError(
            f"release {target} was claimed by a concurrent promotion; releases are never overwritten, "
            "choose a new version"
        )

    try:
        release = _write_release(
            model_name, version, target, run_id, sources, manifests, evaluation_dir, eval_manifest, results, withheld
        )
        # The release manifest goes last: a reader that sees it sees a complete release.
        created = storage.create_if_absent(release_manifest_uri, json.dumps(release, indent=2, sort_keys=True).encode())
    except BaseException as exc:  # disk full, a lost connection, SIGTERM: give the version back
        released = _release_claim(target, claim["claim_id"])
        if isinstance(exc, OSError):
            raise StorageError(
                f"promote {version}: {exc.filename or target}: {exc.strerror or exc}; {released}"
            ) from exc
        if isinstance(exc, StorageError):  # storage already named the path
            raise StorageError(f"promote {version}: {exc}; {released}") from exc
        log.error("promote %s failed: %s", version, released)
        raise
    if not created:
        raise ReleaseExistsError(f"{release_manifest_uri} appeared during the promotion; the claim was bypassed")
    created_at = release["created_at"]
    latest = update_latest(
        model_root,
        {"version": version, "manifest_uri": release_manifest_uri, "created_at": created_at},
        baseline=baseline,
    )
    log.info("released %s %s at %s; latest is %s", model_name, version, target, latest.get("version"))
    return StageResult(
        metrics={},
        summary={
            "status": "published",
            "release_uri": target,
            "version": version,
            "manifest_uri": release_manifest_uri,
            "latest_version": latest.get("version"),
        },
    )


def run(
    *,
    student: str | Path,
    onnx_fp32: str | Path,
    int8_dynamic: str | Path,
    int8_qdq: str | Path,
    engine: str | Path,
    evaluation: str | Path,
    release_root: str,
    model_name: str,
    version: str = "",
    run_id: str = "",
) -> StageResult:
    """The ``promote`` stage: :func:`promote` the gated artifacts, each under its artifact name in the release.

    ``run_id`` (the pipeline run, from the stage's context) is recorded in the release manifest. With MLflow
    tracking on, the release also becomes a model version and the alias ``production`` moves to it by the rule of
    ``latest.json`` (:mod:`lmforge.tracking.promotion`); the summary then says what happened there.
    """
    artifacts = {"student": student, "onnx_fp32": onnx_fp32, "int8_dynamic": int8_dynamic, "int8_qdq": int8_qdq}
    artifacts["engine"] = engine
    baseline = _read_results(Path(evaluation)).get("production")
    if from_alias(baseline):
        check_alias_baseline(release_root, model_name, baseline)
    result = promote(
        model_name=model_name,
        release_root=release_root,
        version=version or default_version(),
        artifacts={name: Path(path) for name, path in artifacts.items()},
        evaluation_dir=evaluation,
        run_id=run_id or None,
    )
    result.summary.update(register_promoted(model_name, result.summary, baseline))
    return result


def _write_release(
    model_name: str,
    version: str,
    target: str,
    run_id: str | None,
    sources: Mapping[str, Path],
    manifests: Mapping[str, Mapping[str, Any]],
    evaluation_dir: Path,
    eval_manifest: Mapping[str, Any],
    results: Mapping[str, Any],
    withheld: Mapping[str, str],
) -> dict[str, Any]:
    """Copy every artifact and the evaluation under ``target``; return the release manifest (not yet written)."""
    lineage: dict[str, Any] = {}
    all_manifests = {**manifests, EVALUATION: eval_manifest}
    for name, source in {**sources, EVALUATION: evaluation_dir}.items():
        dest = storage.join(target, name)
        log.info("copying %s -> %s", source, dest)
        copied = storage.copy_tree(str(source), dest)
        manifest = all_manifests[name]
        lineage[name] = {
            **_artifact_lineage(manifest),
            "source_uri": str(source),
            "uri": dest,
            "files": len(copied),
        }
    return {
        "kind": "release",
        "model_name": model_name,
        "version": version,
        "created_at": _now(),
        "lmforge_version": __version__,
        "run_id": run_id,
        "artifacts": {name: lineage[name] for name in sources},
        "withheld": dict(withheld),
        "evaluation": {
            **lineage[EVALUATION],
            "metrics": eval_manifest.get("metrics", {}),
            "gate": results.get("gate", {}),
            "passed": bool(results.get("passed")),
        },
    }


def _artifact_lineage(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """What identifies an artifact in a release: its kind, content fingerprint and its inputs' fingerprints.

    An input recorded without a fingerprint (a plain URI) counts as ``None``.
    """
    inputs = manifest.get("inputs") or {}
    return {
        "kind": manifest.get("kind"),
        "fingerprint": fingerprint(manifest),
        "inputs": {
            name: record.get("fingerprint") if isinstance(record, Mapping) else None for name, record in inputs.items()
        },
    }


def _serves(release: Mapping[str, Any], manifests: Mapping[str, Mapping[str, Any]]) -> bool:
    """True when ``release`` holds exactly the artifacts of ``manifests`` (by name), each with the same lineage.

    A release made before input fingerprints were recorded never matches, so it is replaced once.
    """
    candidate = {name: _artifact_lineage(manifest) for name, manifest in manifests.items()}
    published = release.get("artifacts")
    if not isinstance(published, Mapping) or set(published) != set(candidate):
        return False
    return all(
        isinstance(published[name], Mapping) and all(published[name].get(k) == v for k, v in lineage.items())
        for name, lineage in candidate.items()
    )


def _release_claim(target: str, claim_id: str) -> str:
    """Delete what a failed promotion wrote under ``target``, its claim last; say what happened.

    Only our own claim is released (its ``claim_id``); until it goes, nobody else can claim the version,
    so deleting the rest first is safe. If this fails too, ``lmforge registry gc`` cleans up later.
    """
    claim_uri = storage.join(target, CLAIM)
    try:
        holder = _parse_json(storage.read_bytes(claim_uri), claim_uri) or {}
        if holder.get("claim_id") != claim_id:
            return f"the claim on {target} is not this promotion's; left alone"
        if storage.is_file(storage.join(target, MANIFEST)):  # the failure came after the release was complete
            return f"the release at {target} is complete and was left in place"
        if storage.is_s3(target):
            for name in storage.list_files(target):
                if name != CLAIM:
                    storage.delete(storage.join(target, name))
            storage.delete(claim_uri)
        else:
            shutil.rmtree(target)
    except (LmforgeError, OSError) as exc:
        return f"its claim on {target} could not be released ({exc}); `lmforge registry gc` removes it later"
    return f"nothing was kept under {target} and the version can be promoted again"


def collect_garbage(
    root: str, *, older_than_s: float, dry_run: bool = False, now: float | None = None
) -> dict[str, list[str]]:
    """Clean what interrupted writers left under ``root`` (a release root or a staging prefix).

    * a promotion's claim (``models/<name>/<version>/.promotion.json``) without a release manifest, older
      than ``older_than_s``: everything under that version is deleted, the claim last, so the version
      can be promoted again;
    * a publisher's claim (``.publishing.json``) without the artifact's manifest, older than that: the
      claim and the files beside it are deleted, so the prefix can be published again;
    * on S3, multipart uploads under ``root`` started longer ago than that are aborted (their parts are
      otherwise stored, and billed, forever; a bucket lifecycle rule does the same: docs/security.md).

    A claim younger than ``older_than_s`` may belong to a promotion that is still copying and is left
    alone. Returns ``{"releases": [...], "artifacts": [...], "uploads": [...]}`` (what was, or with
    ``dry_run`` would be, removed).
    """
    import datetime

    cutoff = (time.time() if now is None else now) - older_than_s
    done: dict[str, list[str]] = {"releases": [], "artifacts": [], "uploads": []}
    names = set(storage.list_files(root)) if storage.exists(root) else set()
    for name in sorted(names):
        folder, _, leaf = name.rpartition("/")
        if leaf not in (CLAIM, PUBLISH_CLAIM) or f"{folder}/{MANIFEST}".lstrip("/") in names:
            continue
        claim_uri = storage.join(root, name)
        claimed_at = (_parse_json(storage.read_bytes(claim_uri), claim_uri) or {}).get("claimed_at")
        try:
            stamp = datetime.datetime.fromisoformat(str(claimed_at)).timestamp()
        except ValueError:
            log.warning("%s: claimed_at %r is not a time; left alone", claim_uri, claimed_at)
            continue
        if stamp > cutoff:
            continue
        folder_uri = storage.join(root, folder) if folder else root
        done["releases" if leaf == CLAIM else "artifacts"].append(folder_uri)
        if dry_run:
            continue
        inside = sorted(n for n in names if n != name and (not folder or n.startswith(f"{folder}/")))
        for other in inside:
            storage.delete(storage.join(root, other))
        storage.delete(claim_uri)
        if not storage.is_s3(root) and folder:
            shutil.rmtree(folder_uri, ignore_errors=True)  # the empty directories left behind
        log.info(
            "removed the stale claim %s (claimed at %s) and %d files beside it", claim_uri, claimed_at, len(inside)
        )
    if storage.is_s3(root):
        done["uploads"] = _abort_uploads(root, cutoff, dry_run)
    return done


def _abort_uploads(root: str, cutoff: float, dry_run: bool) -> list[str]:
    """Abort the multipart uploads under ``root`` started before ``cutoff``; their ``s3://`` keys."""
    bucket, key = storage.split_s3(root)
    prefix = key.rstrip("/") + "/" if key.strip("/") else ""
    client = storage.s3_client()
    pages = storage._s3_call(
        "list multipart uploads",
        root,
        lambda: list(client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix)),
    )
    aborted = []
    for page in pages:
        for upload in page.get("Uploads", []):
            if upload["Initiated"].timestamp() > cutoff:
                continue
            uri = f"{storage.S3_SCHEME}{bucket}/{upload['Key']}"
            aborted.append(uri)
            if not dry_run:
                storage._s3_call(
                    "abort multipart upload",
                    uri,
                    client.abort_multipart_upload,
                    Bucket=bucket,
                    Key=upload["Key"],
                    UploadId=upload["UploadId"],
                )
                log.info("aborted the incomplete multipart upload of %s (started %s)", uri, upload["Initiated"])
    return aborted


def _now() -> str:
    """UTC time with milliseconds (ISO 8601), so releases a second apart still order."""
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


def _state(target: str) -> str:
    if storage.is_file(storage.join(target, MANIFEST)):
        return "a complete release"
    if storage.is_file(storage.join(target, CLAIM)):
        return f"an incomplete release (claimed, no {MANIFEST}: a promotion is running or was interrupted)"
    return f"an incomplete release (no {MANIFEST}; an earlier promotion was interrupted)"
