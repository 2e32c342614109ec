"""Exceptions that carry a message a user can act on.

Every error raised for bad input names the thing that is wrong (field, file, line) in one line.
The CLI prints ``LmforgeError`` messages without a traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class LmforgeError(Exception):
    """Base class: an error caused by input or environment that the user can fix."""


class ConfigError(LmforgeError):
    """A configuration value, preset or override is invalid."""


class InputDataError(LmforgeError):
    """An input corpus, file or artifact is missing, empty or malformed."""


class FieldMissingError(InputDataError):
    """Records lack the field their text is read from; ``fields`` are the ones they have.

    ``text_fields`` are those of ``fields`` that hold text, the longest value first (where known), so a caller
    can suggest which one was meant.
    """

    def __init__(self, message: str, *, field: str, fields: tuple[str, ...], text_fields: tuple[str, ...] = ()):
        super().__init__(message)
        self.field = field
        self.fields = fields
        self.text_fields = text_fields


class StorageError(LmforgeError):
    """Reading or writing a local path or ``s3://`` object failed."""


class WorkerLostError(LmforgeError):
    """A worker process of a stage died (most often killed for memory); the stage wrote no output."""


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


class PreflightError(InputDataError):
    """One or more preflight checks failed; the message lists each."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``choices`` to a mistyped ``name``, else ``""``."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
