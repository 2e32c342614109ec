"""Config of the optional MLflow tracking and model registry (:mod:`lmforge.tracking`)."""

from __future__ import annotations

from pydantic import Field

from lmforge.config.base import StrictModel

_ALIAS = r"^[A-Za-z0-9_-]{1,255}$"


class TrackingConfig(StrictModel):
    """Where and how stages log to MLflow; tracking is off unless a tracking URI is set here or in the env."""

    tracking_uri: str | None = Field(
        None,
        min_length=1,
        description="MLflow tracking server (http(s)://host[:port]); null reads MLFLOW_TRACKING_URI, and "
        "tracking is off (silently) when neither is set. Credentials go in MLFLOW_TRACKING_TOKEN or "
        "MLFLOW_TRACKING_USERNAME/PASSWORD from a Secret, never in the URI.",
    )
    experiment: str | None = Field(
        None,
        min_length=1,
        description="MLflow experiment of the pipeline runs; null uses MLFLOW_EXPERIMENT_ID (set by KFP's "
        "MLflow integration), else MLFLOW_EXPERIMENT_NAME, else 'lmforge'.",
    )
    attempts: int = Field(3, ge=1, le=10, description="Tries per MLflow call before tracking gives up.")
    backoff_s: float = Field(
        0.5, ge=0.0, le=30.0, description="Wait before the second try of a call, doubled before each later one."
    )
    timeout_s: int = Field(
        5,
        ge=1,
        le=300,
        description="Timeout of each HTTP request to MLflow (sets the client's MLFLOW_HTTP_REQUEST_TIMEOUT; its "
        "own retries are turned off, these attempts replace them), so a dead server costs seconds.",
    )
    log_artifacts: bool = Field(
        True, description="Upload each stage's small files (report, results, manifest, training history)."
    )
    max_artifact_bytes: int = Field(
        5_000_000, gt=0, description="Files larger than this are not uploaded (models stay in object storage)."
    )
    max_param_chars: int = Field(
        6000,
        ge=250,
        le=6000,
        description="Config values longer than this are cut to fit as MLflow params (MLflow >= 2.8 accepts "
        "6000; older servers 500).",
    )
    registry: bool = Field(
        True, description="promote also registers the release as an MLflow model version (when tracking is on)."
    )
    registered_model: str | None = Field(
        None,
        min_length=1,
        description="Registered model name in the MLflow Model Registry; null uses promote.model_name.",
    )
    alias: str = Field(
        "production",
        pattern=_ALIAS,
        description="Model version alias that names the production release (moved like latest.json).",
    )
    lock_wait_s: float = Field(
        30.0, gt=0.0, le=600.0, description="How long an alias move waits for a concurrent mover's lock."
    )
    lock_ttl_s: float = Field(
        120.0,
        gt=0.0,
        le=3600.0,
        description="An alias lock older than this was left by a mover that died; the next mover removes it.",
    )
