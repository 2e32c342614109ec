"""The ``promote`` stage: copy gated artifacts into an immutable, versioned release.

Layout under ``release_root`` (a local path or ``s3://bucket/prefix``)::

    models/<name>/<version>/<artifact>/...     one folder per artifact, its own manifest.json last
    models/<name>/<version>/evaluation/...     the evaluation report and results
    models/<name>/<version>/manifest.json      the release manifest (lineage), written last
    models/<name>/latest.json                  {"version", "manifest_uri", "created_at"}, after it

A release whose ``manifest.json`` exists is complete. A version is never overwritten: if anything
exists at the target (a complete release, or the remains of an interrupted promotion), promotion
is refused and a new version must be chosen. Only :mod:`lmforge.storage` touches the target, so the
same code writes to local disk and S3.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmforge import __version__, storage
from lmforge.artifacts import MANIFEST, fingerprint, read_manifest
from lmforge.config import PromoteConfig
from lmforge.errors import ConfigError, InputDataError, ReleaseExistsError
from lmforge.results import StageResult

log = logging.getLogger("lmforge.promote")

VERSION_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
LATEST = "latest.json"
EVALUATION = "evaluation"
RESULTS_FILE = "results.json"


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
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputDataError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from exc


def promote(
    cfg: PromoteConfig,
    *,
    release_root: str,
    version: str,
    artifacts: Mapping[str, str | Path],
    evaluation_dir: str | Path,
    run_id: str | None = None,
    require_passed: bool = True,
) -> StageResult:
    """Publish ``artifacts`` and the evaluation as release ``version`` of ``cfg.model_name``.

    Args:
        cfg: the release name.
        release_root: local directory or ``s3://`` URI holding ``models/``.
        version: release version (``default_version()`` gives a timestamp one).
        artifacts: artifact directories by release folder name; each must carry a manifest.
        evaluation_dir: output of the ``evaluate`` stage (manifest + ``results.json``).
        run_id: pipeline run that produced the release, recorded in the manifest.
        require_passed: refuse an evaluation whose gate failed (the pipeline also guards this).

    Raises:
        ConfigError: bad version or artifact name.
        ArtifactIncompleteError / InputDataError: an input without manifest, or a failed gate.
        ReleaseExistsError: something already exists at the target.
    """
    _check_name("version", version)
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

    model_root = storage.join(release_root, "models", cfg.model_name)
    target = storage.join(model_root, version)
    release_manifest_uri = storage.join(target, MANIFEST)
    if _occupied(target):
        state = (
            "a complete release"
            if storage.is_file(release_manifest_uri)
            else f"an incomplete release (no {MANIFEST}; an earlier promotion was interrupted)"
        )
        raise ReleaseExistsError(
            f"release {target} already exists as {state}; releases are never overwritten, choose a new version"
        )

    lineage: dict[str, Any] = {}
    all_manifests = {**manifests, EVALUATION: eval_manifest}
    for name, source in {**sources, EVALUATION: evaluation_dir}.items():
        dest = storage.join(target, name)
        log.info("copying %s -> %s", source, dest)
        copied = storage.copy_tree(str(source), dest)
        manifest = all_manifests[name]
        lineage[name] = {
            "kind": manifest.get("kind"),
            "fingerprint": fingerprint(manifest),
            "source_uri": str(source),
            "uri": dest,
            "files": len(copied),
        }

    created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    release = {
        "kind": "release",
        "model_name": cfg.model_name,
        "version": version,
        "created_at": created_at,
        "lmforge_version": __version__,
        "run_id": run_id,
        "artifacts": {name: lineage[name] for name in sources},
        "evaluation": {
            **lineage[EVALUATION],
            "metrics": eval_manifest.get("metrics", {}),
            "gate": results.get("gate", {}),
            "passed": bool(results.get("passed")),
        },
    }
    # The release manifest goes last: a reader that sees it sees a complete release.
    storage.write_bytes(release_manifest_uri, json.dumps(release, indent=2, sort_keys=True).encode())
    latest = {"version": version, "manifest_uri": release_manifest_uri, "created_at": created_at}
    storage.write_bytes(storage.join(model_root, LATEST), json.dumps(latest, indent=2).encode())
    log.info("released %s %s at %s", cfg.model_name, version, target)
    return StageResult(
        metrics={},
        summary={"release_uri": target, "version": version, "manifest_uri": release_manifest_uri},
    )
