"""The release registry's read side: which releases exist, which one is production, and its fingerprint.

Layout and protocol: :mod:`lmforge.release.promote` (the write side, the ``promote`` stage). Readers never report a
release without its ``manifest.json``: a ``latest.json`` naming one is ignored in favour of the newest complete
release. ``preflight`` fingerprints the production release (``evaluate``'s cache key), ``evaluate`` records it as
the gate's baseline, ``promote`` re-checks it, serving reads the release it serves.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from typing import Any

from lmforge import storage
from lmforge.artifacts import MANIFEST

log = logging.getLogger("lmforge.release.catalog")

LATEST = "latest.json"
CLAIM = ".promotion.json"  # a promotion's claim on its version, written first


def release_order(entry: Mapping[str, Any]) -> tuple[str, str]:
    """Release order: completion time, then version (ties within a second)."""
    return str(entry.get("created_at") or ""), str(entry.get("version") or "")


def parse_json_object(data: bytes, uri: str) -> dict[str, Any] | None:
    """``data`` as a JSON object, or ``None`` (with a warning naming ``uri``) when it is not one."""
    try:
        value = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        log.warning("%s: not valid JSON; ignored", uri)
        return None
    return value if isinstance(value, dict) else None


def is_complete(latest: Mapping[str, Any]) -> bool:
    """True when the release ``latest`` names has its manifest, of kind release, for that version."""
    uri = latest.get("manifest_uri")
    if not isinstance(uri, str) or not storage.is_file(uri):
        return False
    manifest = parse_json_object(storage.read_bytes(uri), uri)
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


def release_identity(release: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """``(version, fingerprint)`` of a release manifest; ``None`` for no release."""
    return None if release is None else (str(release.get("version")), release_fingerprint(release))


def describe_move(baseline: Mapping[str, Any], now: tuple[str, str] | None) -> str:
    """Why an evaluation's gate baseline is stale: what it compared with, and what is latest now."""
    was = baseline_identity(baseline)
    before = f"production {was[0]} (fingerprint {was[1][:12]})" if was else "no production release"
    after = f"{now[0]} (fingerprint {now[1][:12]})" if now else "no complete release"
    return f"the evaluation's gate compared it with {before}, but the latest release is now {after}"


def effective_latest(model_root: str, latest: Mapping[str, Any] | None, *, exclude: str) -> dict[str, Any] | None:
    """The release a reader takes as latest, given ``latest.json``'s content; ``exclude`` (the release being
    promoted, already complete) does not count as the fall-back newest release."""
    if latest is not None and is_complete(latest):
        return parse_json_object(storage.read_bytes(latest["manifest_uri"]), latest["manifest_uri"])
    others = [r for r in releases_under(model_root) if r.get("version") != exclude]
    return others[-1] if others else None


def list_releases(release_root: str, model_name: str) -> list[dict[str, Any]]:
    """Manifests of the complete releases of ``model_name`` (those with ``manifest.json``), oldest first."""
    return releases_under(storage.join(release_root, "models", model_name))


def releases_under(model_root: str) -> list[dict[str, Any]]:
    """Manifests of the complete releases under ``models/<name>/`` (plus ``manifest_uri``), oldest first."""
    if not storage.exists(model_root):
        return []
    releases = []
    for name in storage.list_files(model_root):
        version, _, rest = name.partition("/")
        if rest != MANIFEST:
            continue
        uri = storage.join(model_root, version, MANIFEST)
        manifest = parse_json_object(storage.read_bytes(uri), uri)
        if manifest and manifest.get("kind") == "release" and manifest.get("version") == version:
            releases.append({**manifest, "manifest_uri": uri})
    return sorted(releases, key=release_order)


def latest_release(release_root: str, model_name: str) -> dict[str, Any] | None:
    """The current production release's manifest (plus ``manifest_uri``), or ``None`` when there is none.

    ``latest.json`` decides; if it is missing, unreadable or names a release without a manifest, the
    newest complete release is returned instead (with a warning): an incomplete release is never latest.
    """
    model_root = storage.join(release_root, "models", model_name)
    uri = storage.join(model_root, LATEST)
    raw, _ = storage.read_tagged(uri)
    latest = parse_json_object(raw, uri) if raw is not None else None
    if latest is not None and is_complete(latest):
        manifest = parse_json_object(storage.read_bytes(latest["manifest_uri"]), latest["manifest_uri"]) or {}
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
