"""What ``promote`` does in MLflow: check the alias before publishing, register the release after.

With tracking on, every promoted release (or the production release a promotion found unchanged) becomes a model
version of the registered model named after the release, and the ``production`` alias moves by the rule of
``latest.json`` (:func:`~lmforge.tracking.registry.register_release`). Tracking failures are warnings then, as
everywhere, unless the gate's baseline came from the alias (``evaluate.production_source: mlflow``): then the
alias *is* production, so a baseline it no longer names fails the promotion before anything is published
(:func:`check_alias_baseline`), and an alias that could not be moved fails it after (:func:`register_promoted`).

MLflow's registry takes only remote sources (``s3://``, ``gs://``, ``https://``, ...) as model versions; a
release under a local release root is not registered (one warning).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from lmforge import storage
from lmforge.errors import ConfigError, GateBaselineMovedError, TrackingError
from lmforge.tracking.registry import production_baseline_from_registry, register_release
from lmforge.tracking.session import tracking_uri

log = logging.getLogger("lmforge.tracking")

MLFLOW_SOURCE = "mlflow"


def from_alias(baseline: Any) -> bool:
    """Whether the gate's recorded baseline was read from the MLflow alias (``production_source: mlflow``)."""
    return isinstance(baseline, Mapping) and baseline.get("source") == MLFLOW_SOURCE


def check_alias_baseline(release_root: str, model_name: str, baseline: Mapping[str, Any]) -> None:
    """Refuse to publish when the alias no longer names the release the gate compared with.

    Raises:
        ConfigError: ``release_root`` is local, so the release could never become a model version.
        GateBaselineMovedError: the alias names another release (or none) now.
        TrackingError: tracking is off or the alias could not be read.
    """
    from lmforge.release.catalog import baseline_identity

    if _local(release_root):
        raise ConfigError(
            f"release_root {release_root!r} is a local path, but the gate's baseline is the MLflow alias "
            "(evaluate.production_source mlflow), which can only name remote releases: use an s3:// release root"
        )
    now = production_baseline_from_registry(model_name)
    if baseline_identity(now) != baseline_identity(baseline):
        was = baseline_identity(baseline)
        after = baseline_identity(now)
        raise GateBaselineMovedError(
            f"the evaluation's gate compared with {was[0] if was else 'no production release'} (the MLflow alias "
            f"production of {model_name}), but the alias names {after[0] if after else 'no version'} now. Evaluate "
            "again against it before promoting"
        )


def register_promoted(model_name: str, summary: Mapping[str, Any], baseline: Any) -> dict[str, Any]:
    """Register the release ``promote`` published or found unchanged; what happened, for the stage's summary.

    Returns ``{}`` when tracking is off or the release is local, else ``registered_model``, ``model_version``,
    ``alias``, ``alias_version``, ``alias_moved`` and ``alias_reason``.

    Raises:
        GateBaselineMovedError / TrackingError: only when the baseline came from the alias (see the module).
    """
    required = from_alias(baseline)
    release_uri = str(summary["release_uri"])
    if tracking_uri() is None and not required:
        return {}
    if _local(release_uri):
        log.warning(
            "release %s is on a local path, which MLflow's model registry does not take as a model version "
            "source; it is not registered (use an s3:// release root)",
            release_uri,
        )
        return {}
    manifest = json.loads(storage.read_bytes(str(summary["manifest_uri"])))
    registration = register_release(
        release_uri, manifest, model_name=model_name, baseline=baseline if isinstance(baseline, Mapping) else None
    )
    if registration is None:
        if required:
            raise TrackingError(
                f"release {release_uri} is complete, but MLflow (see the warning above) could not move the alias "
                "production to it, and with evaluate.production_source mlflow the alias is production"
            )
        return {}
    log.info("MLflow: %s", registration.reason)
    if required and registration.baseline_moved:
        raise GateBaselineMovedError(f"release {release_uri} is complete, but {registration.reason}")
    return {
        "registered_model": registration.model_name,
        "model_version": registration.model_version,
        "alias": registration.alias,
        "alias_version": registration.alias_version,
        "alias_moved": registration.moved,
        "alias_reason": registration.reason,
    }


def _local(uri: str) -> bool:
    return urlsplit(uri).scheme in ("", "file")
