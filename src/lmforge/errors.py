"""Exceptions that carry a message a user can act on.

Every error raised for bad input names the thing that is wrong (field, file, line) in one line.
The CLI prints ``LmforgeError`` messages without a traceback.
"""

from __future__ import annotations


class LmforgeError(Exception):
    """Base class: an error caused by input or environment that the user can fix."""


class ConfigError(LmforgeError):
    """A configuration value, preset or override is invalid."""


class InputDataError(LmforgeError):
    """An input corpus, file or artifact is missing, empty or malformed."""


class StorageError(LmforgeError):
    """Reading or writing a local path or ``s3://`` object failed."""


class UnsafePathError(InputDataError):
    """A file name from outside (a manifest, an S3 key, a symbolic link) would write or read outside its root."""


class ArtifactIncompleteError(InputDataError):
    """An artifact directory or prefix has no (valid) ``manifest.json``, so it is not complete."""


class ReleaseExistsError(StorageError):
    """The release version already exists (completely or partly); releases are never overwritten."""


class TrackingError(LmforgeError):
    """MLflow could not answer where its answer is needed (the gate's baseline from the registry, a run comparison).

    Logging to MLflow never raises this: a tracking failure is a warning and the stage goes on.
    """


class UnsafeCheckpointError(ArtifactIncompleteError):
    """A checkpoint file is not a plain tensor file: loading it could run code, so it is never loaded."""


class ArtifactConflictError(InputDataError):
    """Another writer holds (or already completed) a different artifact at the target; nothing is overwritten."""


class GateBaselineMovedError(InputDataError):
    """The production release the gate compared against is no longer latest; the evaluation is stale."""
