"""Fail-fast checks before any GPU step, and content fingerprints of the external inputs.

The ``preflight`` component runs first: it checks that the corpus and Q&A data are reachable, that
the release root is writable and its store enforces conditional writes, (inside a cluster) that the
S3 credentials Secret exists and, given a launch config for multi-node training, that the cluster
serves its job kind; then it fingerprints the input data. The fingerprints are passed to ``clean``
and ``finetune_lora`` as parameters, so a KFP cache key changes whenever the data behind an unchanged URI changes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lmforge import storage
from lmforge.artifacts import sha256_file
from lmforge.data.demo import is_demo, materialize
from lmforge.errors import ConfigError, LmforgeError, PreflightError, StorageError
from lmforge.launch import check_training_api, parse_launch
from lmforge.results import StageResult

if TYPE_CHECKING:
    from lmforge.config import LaunchConfig

log = logging.getLogger("lmforge.preflight")

DEMO_MODEL_NAME = "lmforge-demo"  # the release name when none is given
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass
class PreflightReport:
    """Outcome of every check (name → ``ok`` or the reason it failed) and the input fingerprints."""

    checks: dict[str, str] = field(default_factory=dict)
    fingerprints: dict[str, str] = field(default_factory=dict)

    @property
    def failed(self) -> dict[str, str]:
        """The checks that did not pass."""
        return {name: result for name, result in self.checks.items() if result != "ok"}


def fingerprint_uri(uri: str) -> str:
    """sha256 over the content of a file, directory, ``s3://`` object/prefix or ``demo://`` corpus.

    Local files are hashed byte for byte; S3 objects contribute their ETag and size (the ETag is an
    MD5 of the content, or of its parts for multipart uploads), so a changed object changes the
    fingerprint without downloading it.
    """
    digest = hashlib.sha256()
    if is_demo(uri):
        with tempfile.TemporaryDirectory(prefix="lmforge-fp-") as workdir:
            digest.update(sha256_file(materialize(uri, workdir)).encode())
        return digest.hexdigest()
    if storage.is_s3(uri):
        names = [""] if storage.is_file(uri) else storage.list_files(uri)
        if not names:
            raise StorageError(f"no such object or prefix: {uri}")
        for name in names:
            etag, size = storage.s3_etag(storage.join(uri, name) if name else uri)
            digest.update(f"{name}\0{etag}\0{size}\n".encode())
        return digest.hexdigest()
    path = Path(uri)
    if not path.exists():
        raise StorageError(f"no such file or directory: {uri}")
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        name = file.name if path.is_file() else file.relative_to(path).as_posix()
        digest.update(f"{name}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()


def check_writable(root: str) -> None:
    """Write and delete a probe object under ``root`` (local path or ``s3://``)."""
    probe = storage.join(root, ".lmforge-preflight", uuid.uuid4().hex)
    storage.write_bytes(probe, b"lmforge preflight probe\n")
    storage.delete(probe)


def check_conditional_writes(root: str) -> str:
    """``ok`` when the object store under ``root`` honours ``If-None-Match: *`` and ``If-Match``; a reason otherwise.

    Release claims, release and artifact manifests (conditional create) and ``latest.json``
    (compare-and-swap) are only exclusive if the server enforces these headers; a server that ignores
    them accepts every write and two promotions both "win". The probe creates an object, creates it
    again (must be refused, content kept), replaces it under a wrong ETag (must be refused) and under
    the right one (must succeed), then deletes it. A local ``root`` uses hard links and a file lock
    instead; its conditional create is probed the same way.
    """
    from lmforge.release import read_tagged, swap_if_unchanged

    probe = storage.join(root, ".lmforge-preflight", f"conditional-{uuid.uuid4().hex}")
    try:
        if not storage.create_if_absent(probe, b"first"):
            return f"{probe}: a conditional create (If-None-Match: *) of a new object was refused"
        if storage.create_if_absent(probe, b"second") or storage.read_bytes(probe) != b"first":
            return (
                f"{root}: the object store ignores If-None-Match: a conditional create replaced an existing "
                "object, so release claims and manifests would not be exclusive; use a server that enforces "
                "conditional writes (AWS S3, MinIO, SeaweedFS >= 3.8x)"
            )
        if not storage.is_s3(root):
            return "ok"
        _, etag = read_tagged(probe)
        if swap_if_unchanged(probe, b"third", '"0123456789abcdef0123456789abcdef"', existed=True):
            return (
                f"{root}: the object store ignores If-Match: a write under a wrong ETag replaced the object, so "
                "latest.json's compare-and-swap would not detect concurrent promotions"
            )
        if not swap_if_unchanged(probe, b"fourth", etag, existed=True):
            return f"{root}: a write with a matching If-Match was refused; compare-and-swap cannot succeed"
        return "ok"
    finally:
        storage.delete(probe)


def check_secret(name: str) -> str:
    """``ok`` when the Secret exists in this pod's namespace; a reason otherwise.

    Outside a cluster (no service-account namespace file) there is nothing to check. With IRSA
    (``AWS_ROLE_ARN`` set) credentials come from the pod identity, not a Secret.
    """
    if not SERVICE_ACCOUNT_NAMESPACE.is_file():
        return "ok"
    if os.environ.get("AWS_ROLE_ARN"):
        return "ok"
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    config.load_incluster_config()
    namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    try:
        client.CoreV1Api().read_namespaced_secret(name, namespace)
    except ApiException as exc:
        return f"Secret {namespace}/{name}: HTTP {exc.status} {exc.reason}"
    return "ok"


def run_checks(
    *,
    corpus_uri: str,
    qa_uri: str,
    release_root: str,
    s3_secret_name: str,
    launch: LaunchConfig | None = None,
    model_name: str = "",
) -> PreflightReport:
    """Run every check, then fingerprint the inputs; raise :class:`PreflightError` listing all failures.

    With ``launch`` asking for more than one node, also check that the cluster serves its job kind. With
    ``model_name``, also fingerprint the production release of that name (``fingerprints["production"]``),
    the baseline ``evaluate`` compares against.
    """
    report = PreflightReport()
    report.checks["s3_secret"] = check_secret(s3_secret_name) if s3_secret_name else "ok"
    if launch is not None and launch.num_nodes > 1:
        report.checks["training_job_api"] = check_training_api(launch)
    for name, uri in (("corpus", corpus_uri), ("qa", qa_uri)):
        try:
            report.fingerprints[name] = fingerprint_uri(uri)
            report.checks[f"{name}_readable"] = "ok"
        except (LmforgeError, OSError) as exc:
            report.checks[f"{name}_readable"] = f"{uri}: {exc}"
    try:
        check_writable(release_root)
        report.checks["release_root_writable"] = "ok"
    except (LmforgeError, OSError) as exc:
        report.checks["release_root_writable"] = f"{release_root}: {exc}"
    else:
        try:
            report.checks["release_root_conditional_writes"] = check_conditional_writes(release_root)
        except (LmforgeError, OSError) as exc:
            report.checks["release_root_conditional_writes"] = f"{release_root}: {exc}"
    if model_name:
        from lmforge.release import production_fingerprint

        try:
            report.fingerprints["production"] = production_fingerprint(release_root, model_name)
            report.checks["production_release_readable"] = "ok"
        except (LmforgeError, OSError) as exc:
            report.checks["production_release_readable"] = f"{release_root} ({model_name}): {exc}"
    for name, result in report.checks.items():
        log.info("preflight %s: %s", name, result)
    if report.failed:
        raise PreflightError("preflight failed: " + "; ".join(f"{k}: {v}" for k, v in report.failed.items()))
    return report


def run(
    *,
    corpus_uri: str,
    qa_uri: str,
    release_root: str,
    s3_secret_name: str = "lmforge-s3",
    launch: str = "{}",
    gpu_count: int = 1,
    model_name: str = "",
) -> StageResult:
    """The ``preflight`` stage: :func:`run_checks`, with the values the later steps take from it.

    Its summary holds ``corpus_fingerprint``, ``qa_fingerprint``, ``production_fingerprint`` (cache keys),
    ``gpu_limit`` (``gpu_count`` as the string the KFP backend needs for an accelerator limit) and the
    resolved ``model_name``.

    Raises:
        ConfigError: ``gpu_count`` below 0 or an invalid ``launch`` config.
        PreflightError: one or more checks failed; the message lists each.
    """
    if gpu_count < 0:
        raise ConfigError(f"gpu_count: must be at least 0, got {gpu_count}")
    name = model_name or DEMO_MODEL_NAME
    report = run_checks(
        corpus_uri=corpus_uri,
        qa_uri=qa_uri,
        release_root=release_root,
        s3_secret_name=s3_secret_name,
        launch=parse_launch(launch),
        model_name=name,
    )
    fp = report.fingerprints
    summary = {
        "corpus_fingerprint": fp["corpus"],
        "qa_fingerprint": fp["qa"],
        "production_fingerprint": fp["production"],
        "gpu_limit": str(gpu_count),
        "model_name": name,
        "checks": report.checks,
    }
    return StageResult(metrics={"checks_passed": float(len(report.checks))}, summary=summary)
