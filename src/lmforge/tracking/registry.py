"""Releases as MLflow model versions, and the production alias moved by the rule of ``latest.json``.

:func:`register_release` creates (once per release URI) a model version whose source is the release's URI
(``s3://.../models/<name>/<version>``: the model registry refuses local paths as sources), tagged with the
release version, its manifest's fingerprint and each artifact's lineage fingerprint, the gate's decision and
checks, and the evaluation metrics (``metric.<name>``). Then it moves the alias (``production``) by the rule
:func:`lmforge.release.promote.update_latest` applies to ``latest.json``: only when the gate passed, only forward (to a
release whose ``(created_at, version)`` is greater than the one the alias names), and, given the gate's
baseline, only while the alias still names that baseline.

MLflow has no conditional alias update, so the read-decide-write runs under a lock: a registered model named
``<model>.<alias>.lock``, whose creation is atomic on the server (a second creator gets
``RESOURCE_ALREADY_EXISTS``). A mover that finds the lock waits (up to ``lock_wait_s``) and then decides on
what the winner left: of two movers gated against the same baseline exactly one moves the alias, the other
loses cleanly (``moved=False`` with the reason). A lock older than ``lock_ttl_s`` was left by a mover that
died and is removed.

:func:`production_baseline_from_registry` reads the alias back in the shape of
:func:`lmforge.release.catalog.production_summary`, for ``evaluate.production_source: mlflow``.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from lmforge.errors import TrackingError
from lmforge.evaluate.gate import check_mark
from lmforge.tracking.redact import as_text
from lmforge.tracking.runs import KFP_RUN_ID, Tracker
from lmforge.tracking.session import Expected, Session, Unavailable

log = logging.getLogger("lmforge.tracking")

RELEASE_URI = "lmforge.release_uri"
RELEASE_VERSION = "lmforge.version"
CREATED_AT = "lmforge.created_at"
FINGERPRINT = "lmforge.release_fingerprint"
MANIFEST_URI = "lmforge.manifest_uri"
GATE_PASSED = "gate.passed"
METRIC_PREFIX = "metric."
_LOCK_OWNER = "lmforge.lock_owner"
_LOCKED_AT = "lmforge.locked_at"
_TAG_CHARS = 5000


@dataclass(frozen=True)
class Registration:
    """What :func:`register_release` did.

    Attributes:
        model_name: the registered model.
        model_version: MLflow's version number of the release.
        release_version: the release's own version (``v20261201-120000``).
        alias: the alias it tried to move.
        alias_version: the MLflow version the alias names afterwards (``None``: none).
        moved: whether this call moved the alias to ``model_version``.
        reason: why it moved or did not.
        baseline_moved: it did not move because the alias no longer names the gate's baseline (the candidate
            must be evaluated again against the release it names now).
    """

    model_name: str
    model_version: str
    release_version: str
    alias: str
    alias_version: str | None
    moved: bool
    reason: str
    baseline_moved: bool = False


def register_release(
    release_uri: str,
    manifest: Mapping[str, Any],
    *,
    gate: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    model_name: str | None = None,
    alias: str | None = None,
    baseline: Mapping[str, Any] | None = None,
    tracker: Tracker | None = None,
) -> Registration | None:
    """Register the release at ``release_uri`` as a model version and move ``alias`` to it if the rule allows.

    Never raises for MLflow failures: it warns once and returns ``None`` (also when tracking is off).

    Args:
        release_uri: the release's folder (``s3://.../models/<name>/<version>``), the version's source.
        manifest: the release's ``manifest.json`` content.
        gate: the gate decision (``{"passed", "checks"}``); default: the manifest's ``evaluation.gate``.
        metrics: evaluation metrics; default: the manifest's ``evaluation.metrics``.
        model_name: registered model; default: ``TrackingConfig.registered_model``, else the manifest's name.
        alias: default ``TrackingConfig.alias``.
        baseline: the gate's production record (``results.json`` ``production``); the alias moves only while
            it still names that release. ``None``: no such check (only forward).
        tracker: the process's tracker (default: a new one from the environment).
    """
    tracker = tracker or Tracker()
    session = tracker.session
    if session is None or not tracker.cfg.registry:
        return None
    evaluation = manifest.get("evaluation") or {}
    gate = gate if gate is not None else evaluation.get("gate") or {}
    metrics = metrics if metrics is not None else evaluation.get("metrics") or {}
    name = model_name or tracker.cfg.registered_model or str(manifest.get("model_name") or "")
    alias = alias or tracker.cfg.alias
    try:
        if not name or "'" in name:
            session.give_up(f"registered model name {name!r} is empty or contains a quote")
        tags = _version_tags(release_uri, manifest, gate, metrics, tracker)
        source = tracker.scrub.text(release_uri)
        _ensure_model(session, name)
        version = _version_of(session, name, source) or _create_version(
            session, name, source, tags, _run_link(tracker, manifest)
        )
        release_version = str(manifest.get("version"))
        if not gate.get("passed"):
            current = _alias_target(session, name, alias)
            reason = f"the gate did not pass; {alias} stays at {_describe(current)}"
            return Registration(name, str(version.version), release_version, alias, _num(current), False, reason)
        try:
            with _alias_lock(session, tracker, name, alias):
                return _move_alias(session, name, alias, version, baseline)
        except _LockBusy as busy:
            log.warning("%s", busy)
            return Registration(name, str(version.version), release_version, alias, None, False, str(busy))
    except Unavailable:
        return None


def production_baseline_from_registry(
    model_name: str, alias: str = "production", *, tracker: Tracker | None = None
) -> dict[str, Any]:
    """What the gate compares against, read from the model version ``alias`` names (see ``production_summary``).

    Returns ``{"status": "none", "reason"}`` when the model or alias does not exist yet, else ``{"status":
    "found", "version", "manifest_uri", "fingerprint", "created_at", "metrics", "source": "mlflow",
    "registered_model", "model_version"}``.

    Raises:
        TrackingError: tracking is off or the server did not answer; the gate must not pass on a baseline it
            could not read.
    """
    tracker = tracker or Tracker()
    session = tracker.session
    if session is None:
        raise TrackingError(
            "evaluate.production_source is mlflow but no MLflow tracking URI is configured (MLFLOW_TRACKING_URI)"
        )
    try:
        try:
            model = session.call(
                f"get registered model {model_name!r}",
                lambda c: c.get_registered_model(model_name),
                expected=("RESOURCE_DOES_NOT_EXIST",),
            )
        except Expected:
            return {"status": "none", "reason": f"no registered model {model_name!r} in {session.display_uri} yet"}
        number = _aliases(model).get(alias)
        if number is None:
            return {"status": "none", "reason": f"no version of {model_name!r} has alias {alias!r} yet"}
        mv = session.call(f"get {model_name} version {number}", lambda c: c.get_model_version(model_name, number))
    except Unavailable as exc:
        raise TrackingError(
            f"the production baseline could not be read from MLflow at {session.display_uri}: {exc}"
        ) from exc
    tags = dict(mv.tags or {})
    metrics = {}
    for key, value in tags.items():
        if key.startswith(METRIC_PREFIX):
            with contextlib.suppress(ValueError):
                metrics[key.removeprefix(METRIC_PREFIX)] = float(value)
    version, fingerprint = _identity(mv)
    return {
        "status": "found",
        "version": version,
        "manifest_uri": tags.get(MANIFEST_URI),
        "fingerprint": fingerprint,
        "created_at": tags.get(CREATED_AT),
        "metrics": metrics,
        "source": "mlflow",
        "registered_model": model_name,
        "model_version": mv.version,
    }


def _version_tags(
    release_uri: str,
    manifest: Mapping[str, Any],
    gate: Mapping[str, Any],
    metrics: Mapping[str, Any],
    tracker: Tracker,
) -> dict[str, str]:
    from lmforge.artifacts import MANIFEST
    from lmforge.release.catalog import release_fingerprint

    tags: dict[str, Any] = {
        RELEASE_URI: release_uri,
        RELEASE_VERSION: manifest.get("version"),
        CREATED_AT: manifest.get("created_at"),
        FINGERPRINT: release_fingerprint(manifest),
        MANIFEST_URI: manifest.get("manifest_uri") or f"{release_uri.rstrip('/')}/{MANIFEST}",
        "lmforge.lmforge_version": manifest.get("lmforge_version"),
        KFP_RUN_ID: manifest.get("run_id"),
        GATE_PASSED: bool(gate.get("passed")),
    }
    lineage = {**(manifest.get("artifacts") or {}), "evaluation": manifest.get("evaluation") or {}}
    for artifact, entry in lineage.items():
        if isinstance(entry, Mapping) and entry.get("fingerprint"):
            tags[f"lineage.{artifact}.fingerprint"] = entry["fingerprint"]
    for check in gate.get("checks") or []:
        if isinstance(check, Mapping) and "name" in check:
            tags[f"gate.{check['name']}"] = f"{check_mark(check)}: {check.get('reason', '')}"
    for key, value in metrics.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            tags[f"{METRIC_PREFIX}{key}"] = repr(float(value))
    tags = {k: as_text(v) for k, v in tags.items() if v is not None}
    return tracker.scrub.mapping(tags, limit=_TAG_CHARS)


def _ensure_model(session: Session, name: str) -> None:
    with contextlib.suppress(Expected):
        session.call(
            f"create registered model {name!r}",
            lambda c: c.create_registered_model(name, description="lmforge releases (promote)"),
            expected=("RESOURCE_ALREADY_EXISTS",),
        )


def _version_of(session: Session, name: str, release_uri: str) -> Any | None:
    """The model version already registered for ``release_uri`` (a retried promote registers nothing twice)."""
    token = None
    while True:
        page = session.call(
            f"list versions of {name!r}",
            lambda c, token=token: c.search_model_versions(f"name='{name}'", max_results=200, page_token=token),
        )
        for mv in page:
            if mv.source == release_uri:
                return mv
        token = page.token
        if not token:
            return None


def _create_version(session: Session, name: str, release_uri: str, tags: Mapping[str, str], run_id: str | None) -> Any:
    mv = session.call(
        f"register {release_uri} as a version of {name!r}",
        lambda c: c.create_model_version(
            name,
            release_uri,
            run_id=run_id,
            tags=dict(tags),
            description=f"lmforge release {tags.get(RELEASE_VERSION)} ({release_uri})",
        ),
    )
    log.info("registered %s as version %s of %s", release_uri, mv.version, name)
    return mv


def _run_link(tracker: Tracker, manifest: Mapping[str, Any]) -> str | None:
    """The pipeline's parent MLflow run, when the release records its KFP run and that run is tracked."""
    from lmforge.tracking.runs import PipelineRun

    run_id = manifest.get("run_id")
    return tracker.pipeline_run_id(PipelineRun(str(run_id)), create=False) if run_id else None


def _aliases(model: Any) -> dict[str, str]:
    aliases = model.aliases or {}
    if isinstance(aliases, Mapping):
        return {str(k): str(v) for k, v in aliases.items()}
    return {a.alias: str(a.version) for a in aliases}


def _alias_target(session: Session, name: str, alias: str) -> Any | None:
    model = session.call(f"get registered model {name!r}", lambda c: c.get_registered_model(name))
    number = _aliases(model).get(alias)
    if number is None:
        return None
    return session.call(f"get {name} version {number}", lambda c: c.get_model_version(name, number))


def _identity(mv: Any | None) -> tuple[str, str] | None:
    """``(release version, fingerprint)`` of a model version, as a gate baseline records a release."""
    if mv is None:
        return None
    tags = dict(mv.tags or {})
    return tags.get(RELEASE_VERSION) or f"mlflow-{mv.version}", tags.get(FINGERPRINT) or ""


def _order(mv: Any) -> tuple[str, str]:
    """Release order of a model version: its release's completion time, then release version (as latest.json)."""
    tags = dict(mv.tags or {})
    created = tags.get(CREATED_AT)
    if not created:
        stamp = datetime.datetime.fromtimestamp((mv.creation_timestamp or 0) / 1000, tz=datetime.UTC)
        created = stamp.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    return created, tags.get(RELEASE_VERSION) or ""


def _num(mv: Any | None) -> str | None:
    return None if mv is None else str(mv.version)


def _describe(mv: Any | None) -> str:
    if mv is None:
        return "no version"
    return f"version {mv.version} ({_identity(mv)[0]})"


def _move_alias(
    session: Session, name: str, alias: str, candidate: Any, baseline: Mapping[str, Any] | None
) -> Registration:
    """Under the lock: read where the alias points, decide, move (or not)."""
    from lmforge.release.catalog import baseline_identity

    release = _identity(candidate)[0]
    current = _alias_target(session, name, alias)

    def outcome(moved: bool, reason: str, *, baseline_moved: bool = False) -> Registration:
        now = candidate.version if moved else _num(current)
        return Registration(name, str(candidate.version), release, alias, now, moved, reason, baseline_moved)

    if current is not None and str(current.version) == str(candidate.version):
        return outcome(False, f"{alias} already names version {candidate.version}")
    if baseline is not None and _identity(current) != baseline_identity(baseline):
        was = baseline_identity(baseline)
        return outcome(
            False,
            f"the gate compared with {was[0] if was else 'no production release'}, but {alias} is now "
            f"{_describe(current)}; {alias} left there (evaluate again against it)",
            baseline_moved=True,
        )
    if current is not None and _order(current) >= _order(candidate):
        return outcome(False, f"{alias} stays at {_describe(current)}, newer than {release}")
    session.call(
        f"move {alias} to version {candidate.version}",
        lambda c: c.set_registered_model_alias(name, alias, str(candidate.version)),
    )
    log.info("%s %s -> version %s (%s)", name, alias, candidate.version, release)
    return outcome(True, f"{alias} moved from {_describe(current)} to version {candidate.version} ({release})")


# MLflow's SQL store answers a create that hits an existing name by reading that model back to word its error
# (mlflow/store/model_registry/sqlalchemy_store.py, create_registered_model, ``except IntegrityError``). When the
# holder removes the lock between the two, the refusal comes back as RESOURCE_DOES_NOT_EXIST: the lock is free
# again, so the mover waits its turn and tries again.
_LOCK_RELEASED_MEANWHILE = "RESOURCE_DOES_NOT_EXIST"


class _LockBusy(Exception):
    """Another mover held the alias lock for longer than ``lock_wait_s``."""


@contextlib.contextmanager
def _alias_lock(session: Session, tracker: Tracker, name: str, alias: str) -> Iterator[None]:
    """Hold ``<name>.<alias>.lock`` (a registered model: creating one is atomic) for the block."""
    lock = f"{name}.{alias}.lock"
    owner = uuid.uuid4().hex
    deadline = time.monotonic() + tracker.cfg.lock_wait_s
    wait = 0.05
    while True:
        try:
            session.call(
                "take the alias lock",
                lambda c: c.create_registered_model(
                    lock,
                    tags={_LOCK_OWNER: owner, _LOCKED_AT: repr(time.time())},
                    description=f"lmforge: held while {alias} of {name} is moved; removed after",
                ),
                expected=("RESOURCE_ALREADY_EXISTS", _LOCK_RELEASED_MEANWHILE),
            )
            break
        except Expected as refused:
            holder = None if refused.code == _LOCK_RELEASED_MEANWHILE else _lock_holder(session, lock)
            if holder is not None and holder[0] == owner:  # our create succeeded but its answer was lost
                break
            if holder is not None and time.time() - holder[1] > tracker.cfg.lock_ttl_s:
                log.warning(
                    "removing the alias lock %s left %.0f s ago by a mover that died", lock, time.time() - holder[1]
                )
                _delete_lock(session, lock)
                continue
        if time.monotonic() > deadline:
            raise _LockBusy(
                f"{lock} was held by another mover for over {tracker.cfg.lock_wait_s:.0f} s; {alias} not moved"
            )
        time.sleep(wait)
        wait = min(wait * 2, 1.0)
    try:
        yield
    finally:
        with contextlib.suppress(Unavailable):
            holder = _lock_holder(session, lock)
            if holder is not None and holder[0] == owner:
                _delete_lock(session, lock)


def _lock_holder(session: Session, lock: str) -> tuple[str, float] | None:
    try:
        model = session.call(
            "read the alias lock", lambda c: c.get_registered_model(lock), expected=("RESOURCE_DOES_NOT_EXIST",)
        )
    except Expected:
        return None
    tags = dict(model.tags or {})
    try:
        locked_at = float(tags.get(_LOCKED_AT, ""))
    except ValueError:
        locked_at = (model.creation_timestamp or 0) / 1000
    return tags.get(_LOCK_OWNER, ""), locked_at


def _delete_lock(session: Session, lock: str) -> None:
    with contextlib.suppress(Expected):
        session.call(
            "remove the alias lock", lambda c: c.delete_registered_model(lock), expected=("RESOURCE_DOES_NOT_EXIST",)
        )
