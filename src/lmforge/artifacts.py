"""Artifact directories with commit semantics.

Every stage writes its output directory through :func:`staged_output`: files go into a hidden sibling
directory, ``manifest.json`` (what it is, inputs, config, per-file sha256) is written last, and the
directory is renamed into place. A directory without a manifest is incomplete, and
:func:`read_manifest` refuses it. An artifact is made of regular files only: a symbolic link in it is refused
when it is described or copied, and every name a manifest lists must stay inside the artifact
(:func:`lmforge.storage.safe_join`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from lmforge import __version__
from lmforge.errors import ArtifactIncompleteError, InputDataError, LmforgeError, StorageError
from lmforge.scratch import scratch_dir
from lmforge.storage import local_files, safe_join, write_bytes, write_error

MANIFEST = "manifest.json"
PUBLISH_CLAIM = ".publishing.json"
"""Created (conditionally) in a remote prefix by the one publisher allowed to write an artifact there."""
_CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def describe_files(root: str | Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"sha256", "bytes"}}`` for every file under ``root`` except the manifest.

    Raises:
        UnsafePathError: a symbolic link under ``root`` (never followed).
    """
    root = Path(root)
    return {
        name: {"sha256": sha256_file(root / name), "bytes": (root / name).stat().st_size}
        for name in local_files(root)
        if Path(name).name != MANIFEST
    }


# Files that record how a run went rather than what it made: the training history (tokens/s, seconds;
# contracts.HISTORY_FILE), TensorBoard event files (wall times, named by time, host and pid), rendered reports and a
# stage's stats (timings). The manifest lists and verifies them like any file, but the content fingerprint leaves
# them out: a re-run on unchanged inputs that makes the same model files has the same fingerprint.
RUN_RECORD_FILES = frozenset({"training_history.json", "report.html", "stats.json"})
RUN_RECORD_DIRS = ("tensorboard/",)


def is_run_record(name: str) -> bool:
    """True for a file (path relative to its artifact) that records the run, not the artifact's content."""
    return Path(name).name in RUN_RECORD_FILES or name.startswith(RUN_RECORD_DIRS)


def fingerprint(manifest: Mapping[str, Any]) -> str:
    """A content fingerprint of an artifact: sha256 over its files' hashes (stable across copies and re-runs).

    Run records (:func:`is_run_record`: timings, event logs, reports) are left out.
    """
    files = {name: meta for name, meta in manifest.get("files", {}).items() if not is_run_record(name)}
    joined = "\n".join(f"{name}:{meta['sha256']}" for name, meta in sorted(files.items()))
    return hashlib.sha256(joined.encode()).hexdigest()


def write_manifest(
    root: str | Path,
    kind: str,
    *,
    inputs: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Describe every file in ``root`` and write ``manifest.json`` last, atomically."""
    manifest: dict[str, Any] = {
        "kind": kind,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "lmforge_version": __version__,
        "inputs": dict(inputs or {}),
        "config": dict(config or {}),
        "metrics": dict(metrics or {}),
        "files": describe_files(root),
        **dict(extra or {}),
    }
    write_bytes(str(Path(root, MANIFEST)), json.dumps(manifest, indent=2, sort_keys=True).encode())
    return manifest


def read_json_file(path: str | Path, *, error: type[LmforgeError] = InputDataError) -> Any:
    """Parse a JSON file; invalid JSON raises ``error`` naming the file and line."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from exc


def read_manifest(root: str | Path, *, verify: bool = False) -> dict[str, Any]:
    """Load an artifact's manifest; refuse a directory without one. With ``verify``, check every sha256."""
    path = Path(root, MANIFEST)
    if not Path(root).is_dir():
        raise InputDataError(f"artifact directory not found: {root}")
    if not path.is_file():
        raise ArtifactIncompleteError(f"{root}: no {MANIFEST}; the artifact is incomplete or not an lmforge output")
    manifest = read_json_file(path, error=ArtifactIncompleteError)
    files = manifest.get("files", {}) if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(isinstance(m, dict) and "sha256" in m for m in files.values()):
        raise ArtifactIncompleteError(f"{path}: not an lmforge manifest ('files' must map names to sha256 records)")
    for name in files:
        safe_join(root, name, where=str(path))
    if verify:
        for name, meta in files.items():
            file = Path(root, name)
            if file.is_symlink() or not file.is_file():
                raise ArtifactIncompleteError(f"{root}: {name} listed in the manifest is missing or not a file")
            actual = sha256_file(file)
            if actual != meta["sha256"]:
                raise ArtifactIncompleteError(f"{file}: sha256 mismatch, expected {meta['sha256']}, got {actual}")
    return manifest


def input_record(root: str | Path) -> dict[str, Any]:
    """What a downstream manifest records about one input artifact: its path, kind and fingerprint."""
    manifest = read_manifest(root)
    return {"uri": str(root), "kind": manifest.get("kind"), "fingerprint": fingerprint(manifest)}


# Errors of the disk rather than of the code: reported in one line naming the path (no traceback).
_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO})


@contextlib.contextmanager
def staged_output(final: str | Path) -> Iterator[Path]:
    """Yield a scratch directory; on success rename it to ``final``, on error delete it.

    ``final`` may already exist as an empty directory (KFP creates some output paths); a non-empty
    ``final`` is refused so that nothing already written is lost. Scratch directories of ``final`` left by a
    killed process are removed first (:mod:`lmforge.scratch`). A disk error (full, quota, read-only,
    permission) while writing raises :class:`~lmforge.errors.StorageError` naming the path.
    """
    final = Path(final)
    if final.exists() and (final.is_file() or any(final.iterdir())):
        raise InputDataError(f"output {final} already exists and is not empty; refusing to overwrite it")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_error(final, exc) from exc
    with scratch_dir(f".{final.name}.partial-", final.parent) as scratch:
        try:
            yield scratch
            if final.exists():
                final.rmdir()
            os.replace(scratch, final)
        except OSError as exc:
            if exc.errno not in _DISK_ERRNOS:
                raise
            if exc.filename is None or Path(exc.filename).is_relative_to(scratch):
                raise write_error(final, exc) from exc
            raise StorageError(f"{exc.filename}: {exc.strerror or exc}") from exc
