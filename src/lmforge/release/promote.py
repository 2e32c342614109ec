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
would publish has the same kind, content (:func:`~lmforge.artifacts.fingerprint`: its files' sha256 less
run records such as timings) and input fingerprints as the production release's, and none is missing or
extra, it returns that release (summary ``status: unchanged``) without claiming a version. The check is made
against production at the time of promotion: two concurrent promotions of one new model both publish.

MLflow. With tracking on, the ``promote`` stage (:func:`run`) also registers the release as an MLflow model
version and moves the alias ``production`` by the same rule (:mod:`lmforge.tracking.promotion`). When the gate's
baseline came from that alias (``evaluate.production_source: mlflow``), the alias is production: it is re-checked
instead of ``latest.json``, which then only moves forward.

Conditional writes need an S3 server that implements them (AWS S3, MinIO, SeaweedFS ≥ 3.8x; the test
server checks it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from lmforge import __version__, storage
from lmforge.artifacts import MANIFEST, fingerprint, read_manifest
from lmforge.contracts import gate_result, read_results
from lmforge.errors import (
    ConfigError,
    GateBaselineMovedError,
    InputDataError,
    LmforgeError,
    ReleaseExistsError,
    StorageError,
)
from lmforge.release.catalog import (
    CLAIM,
    LATEST,
    baseline_identity,
    describe_move,
    effective_latest,
    is_complete,
    latest_release,
    parse_json_object,
    release_identity,
    release_order,
)
from lmforge.release.model_card import write_cards
from lmforge.results import StageResult
from lmforge.run_context import IMAGES_ENV
from lmforge.tracking.promotion import check_alias_baseline, from_alias, register_promoted

log = logging.getLogger("lmforge.promote")

VERSION_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
EVALUATION = "evaluation"
_CAS_ATTEMPTS = 20
HOST = "host"


def default_version() -> str:
    """A version from the current UTC time: ``vYYYYMMDD-HHMMSS``."""
    return time.strftime("v%Y%m%d-%H%M%S", time.gmtime())


def _check_name(kind: str, value: str) -> None:
    if not VERSION_PATTERN.fullmatch(value or ""):
        raise ConfigError(
            f"invalid {kind} {value!r}: use letters, digits, '.', '_' or '-', starting with a letter or digit"
        )


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
            raw, etag = storage.read_tagged(uri)
            current = parse_json_object(raw, uri) if raw is not None else None
            if baseline is not None:
                now = release_identity(effective_latest(model_root, current, exclude=str(entry.get("version"))))
                if now != baseline_identity(baseline):
                    raise GateBaselineMovedError(
                        f"release {entry.get('version')} is complete at {entry.get('manifest_uri')} but latest.json "
                        f"was not moved to it: {describe_move(baseline, now)}. Evaluate it again against the current "
                        "production release and promote a new version if it passes"
                    )
            if current is not None and release_order(current) >= release_order(entry) and is_complete(current):
                log.info("latest.json stays at %s (newer than %s)", current.get("version"), entry.get("version"))
                return current
            if storage.swap_if_unchanged(uri, data, etag, existed=raw is not None):
                return dict(entry)
            time.sleep(0.05)
    raise StorageError(f"{uri}: changed concurrently {_CAS_ATTEMPTS} times in a row; latest.json not updated")


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
    _check_release_names(model_name, version, artifacts)
    evaluation_dir = Path(evaluation_dir)
    eval_manifest, results = _read_evaluation(evaluation_dir, require_passed)
    sources, manifests, withheld = _gated_artifacts(artifacts)
    model_root = storage.join(release_root, "models", model_name)
    production = latest_release(release_root, model_name)
    if production is not None and _serves(production, {name: manifests[name] for name in sources}):
        return _unchanged(model_name, model_root, production)
    target = storage.join(model_root, version)
    release_manifest_uri = storage.join(target, MANIFEST)
    baseline = _gate_baseline(results.get("production"), production, evaluation_dir)
    claim_id = _claim(target, run_id)
    with _claim_given_back_on_failure(target, claim_id, version):
        release = _write_release(
            model_name, version, target, run_id, sources, manifests, evaluation_dir, eval_manifest, results, withheld
        )
        # The release manifest goes last: a reader that sees it sees a complete release.
        created = storage.create_if_absent(release_manifest_uri, json.dumps(release, indent=2, sort_keys=True).encode())
    if not created:
        raise ReleaseExistsError(f"{release_manifest_uri} appeared during the promotion; the claim was bypassed")
    latest = update_latest(
        model_root,
        {"version": version, "manifest_uri": release_manifest_uri, "created_at": release["created_at"]},
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


def _check_release_names(model_name: str, version: str, artifacts: Mapping[str, str | Path]) -> None:
    """Refuse an invalid version, model name or artifact name, a reserved artifact name, or no artifacts."""
    _check_name("version", version)
    _check_name("model name", model_name)
    for name in artifacts:
        _check_name("artifact name", name)
        if name in (MANIFEST, EVALUATION):
            raise ConfigError(f"artifact name {name!r} is reserved in a release")
    if not artifacts:
        raise InputDataError("promote: no artifacts given")


def _read_evaluation(evaluation_dir: Path, require_passed: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The evaluation's manifest and ``results.json``; with ``require_passed``, refuse one whose gate failed."""
    eval_manifest = read_manifest(evaluation_dir, verify=True)
    if eval_manifest.get("kind") != "evaluation":
        raise InputDataError(f"{evaluation_dir}: manifest kind {eval_manifest.get('kind')!r}, expected 'evaluation'")
    results = read_results(evaluation_dir)
    if require_passed and not results.get("passed"):
        gate = results.get("gate") or {}
        failed = gate.get("failed") or [c["name"] for c in gate.get("checks", []) if not c.get("passed")]
        raise InputDataError(
            f"evaluation {evaluation_dir} did not pass the gate (failed: {', '.join(failed) or 'unknown'}); "
            "refusing to promote"
        )
    return eval_manifest, results


def _gated_artifacts(
    artifacts: Mapping[str, str | Path],
) -> tuple[dict[str, Path], dict[str, dict[str, Any]], dict[str, str]]:
    """``(sources, manifests, withheld)``: the artifacts that passed their accuracy gate, every artifact's manifest,
    and why each of the others is withheld (warned of).

    Raises:
        InputDataError: every artifact failed its accuracy gate.
    """
    sources = {name: Path(path) for name, path in artifacts.items()}
    manifests = {name: read_manifest(path, verify=True) for name, path in sources.items()}
    withheld = {name: gate["reason"] for name, path in sources.items() if not (gate := gate_result(path))["accepted"]}
    for name, reason in withheld.items():
        log.warning("withholding %s from the release: its accuracy gate %s", name, reason)
    sources = {name: path for name, path in sources.items() if name not in withheld}
    if not sources:
        raise InputDataError(f"promote: every artifact failed its accuracy gate ({', '.join(withheld)})")
    return sources, manifests, withheld


def _unchanged(model_name: str, model_root: str, production: Mapping[str, Any]) -> StageResult:
    """The result of a promotion whose artifacts ``production`` already serves: nothing published."""
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


def _gate_baseline(
    baseline: Any, production: Mapping[str, Any] | None, evaluation_dir: Path
) -> Mapping[str, Any] | None:
    """The production record the evaluation was gated against (``results["production"]``), which ``latest.json``
    must still name when it moves; ``None`` when the MLflow alias is production (promote's caller checks it,
    ``latest.json`` only follows) or when the evaluation records none (warned of).

    Raises:
        GateBaselineMovedError: production is another release now.
    """
    if from_alias(baseline):
        return None
    if not isinstance(baseline, Mapping):
        log.warning(
            "%s records no gate baseline (production); latest.json is moved without re-checking it", evaluation_dir
        )
        return None
    now = release_identity(production)
    if now != baseline_identity(baseline):
        raise GateBaselineMovedError(
            f"evaluation {evaluation_dir} is stale: {describe_move(baseline, now)}. Evaluate again against the "
            "current production release before promoting"
        )
    return baseline


def _claim(target: str, run_id: str | None) -> str:
    """Claim the version at ``target`` (conditional create of its claim); the claim's id.

    Raises:
        ReleaseExistsError: a complete release, another promotion's claim or an interrupted one's remains is there.
    """
    refused = "releases are never overwritten, choose a new version"
    if storage.is_file(storage.join(target, MANIFEST)):
        raise ReleaseExistsError(f"release {target} already exists as a complete release; {refused}")
    claim = {"run_id": run_id, "claim_id": uuid.uuid4().hex, "claimed_at": _now()}
    claim_uri = storage.join(target, CLAIM)
    if not storage.create_if_absent(claim_uri, json.dumps(claim).encode()):
        raise ReleaseExistsError(f"release {target} {_held_by_another(target)}; {refused}")
    if leftovers := _leftovers(target):
        storage.delete(claim_uri)  # ours, taken a moment ago: nothing else was written
        raise ReleaseExistsError(
            f"release {target} already exists as an incomplete release ({leftovers[0]} and no {MANIFEST} or claim: "
            f"an earlier promotion was interrupted); {refused}"
        )
    return claim["claim_id"]


@contextlib.contextmanager
def _claim_given_back_on_failure(target: str, claim_id: str, version: str) -> Iterator[None]:
    """When the block fails (disk full, a lost connection, SIGTERM), give the version back (:func:`_release_claim`)
    and say so: in the :class:`StorageError` raised for a storage failure, else in the log."""
    try:
        yield
    except BaseException as exc:
        released = _release_claim(target, claim_id)
        if isinstance(exc, OSError):
            raise StorageError(
                f"promote {version}: {exc.filename or target}: {exc.strerror or exc}; {released}"
            ) from exc
        if isinstance(exc, StorageError):  # storage already named the path
            raise StorageError(f"promote {version}: {exc}; {released}") from exc
        log.error("promote %s failed: %s", version, released)
        raise


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
    baseline = read_results(Path(evaluation)).get("production")
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
    write_cards(
        target, list(sources), model_name=model_name, version=version, results=results, evaluation=eval_manifest
    )
    return {
        "kind": "release",
        "model_name": model_name,
        "version": version,
        "created_at": _now(),
        "lmforge_version": __version__,
        "run_id": run_id,
        "artifacts": {name: lineage[name] for name in sources},
        "withheld": dict(withheld),
        "images": stage_images(),
        "evaluation": {
            **lineage[EVALUATION],
            "metrics": eval_manifest.get("metrics", {}),
            "gate": results.get("gate", {}),
            "passed": bool(results.get("passed")),
        },
    }


def stage_images() -> dict[str, Any]:
    """``{stage: image}``: what each registry stage ran in (``$LMFORGE_IMAGES``, by the stage's runtime), or
    ``"host"`` for a stage run by the host's Python (the subprocess runner, tests)."""
    from lmforge.stages import STAGES

    try:
        images = json.loads(os.environ.get(IMAGES_ENV) or "{}")
    except json.JSONDecodeError as exc:
        raise ConfigError(f"${IMAGES_ENV}: not JSON ({exc})") from exc
    if not isinstance(images, dict):
        raise ConfigError(f"${IMAGES_ENV}: expected a JSON object of runtime -> image, got {type(images).__name__}")
    return {name: images.get(spec.runtime, HOST) for name, spec in sorted(STAGES.items())}


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
        holder = parse_json_object(storage.read_bytes(claim_uri), claim_uri) or {}
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


def _now() -> str:
    """UTC time with milliseconds (ISO 8601), so releases a second apart still order."""
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


def _held_by_another(target: str) -> str:
    """What holds ``target`` when this promotion could not claim it: a complete release, or another's claim."""
    if storage.is_file(storage.join(target, MANIFEST)):
        return "already exists as a complete release"
    claim_uri = storage.join(target, CLAIM)
    try:
        holder = parse_json_object(storage.read_bytes(claim_uri), claim_uri) or {}
    except LmforgeError:  # released in the meantime: the other promotion failed and gave the version back
        return "was claimed by a concurrent promotion"
    by = f", run {holder['run_id']}" if holder.get("run_id") else ""
    return (
        f"is claimed by another promotion (since {holder.get('claimed_at', '?')}{by}): it is in progress, or it was "
        f"killed before writing {MANIFEST} and `lmforge registry gc` removes its claim"
    )


def _leftovers(target: str) -> list[str]:
    """What lies under ``target`` besides its claim (and another contender's claim being written), sorted."""
    if storage.is_s3(target):
        return [name for name in storage.list_files(target) if name != CLAIM]
    in_flight = re.compile(rf"^\.{re.escape(CLAIM)}\..*\.tmp$")  # storage.create_if_absent's temporary name
    return sorted(name for name in os.listdir(target) if name != CLAIM and not in_flight.match(name))
