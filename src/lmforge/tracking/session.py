"""One connection to an MLflow tracking server: on/off, rank 0 only, bounded retries, one warning.

:func:`open_session` returns ``None`` (and imports nothing from MLflow) when no tracking URI is configured or
the process is not rank 0. A :class:`Session` runs every MLflow call through :meth:`Session.call`: with the
client's own retries off and a short request timeout, a call is tried ``attempts`` times with doubling
waits; refused credentials (401/403) and other rejected requests (4xx) are not retried, since waiting does
not change them. When a call still fails, the session warns once, naming the tracking URI (password
redacted) and the reason, and is *broken*: later calls raise :class:`Unavailable` at once without touching
the network, so a dead server costs one bounded retry sequence per session, not one per call.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from lmforge.config.tracking import TrackingConfig
from lmforge.tracking.redact import Scrubber, redact_url

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

log = logging.getLogger("lmforge.tracking")

T = TypeVar("T")
DEFAULT_EXPERIMENT = "lmforge"
# Answers that waiting does not change: refused credentials, and requests the server rejects as such.
_PERMANENT_CODES = (
    "UNAUTHENTICATED",
    "PERMISSION_DENIED",
    "INVALID_PARAMETER_VALUE",
    "RESOURCE_DOES_NOT_EXIST",
    "RESOURCE_ALREADY_EXISTS",
    "BAD_REQUEST",
)
_RETRYABLE_4XX = (408, 429)


class Unavailable(Exception):
    """Tracking failed (already reported in the warning) or was broken before; the caller skips what is left."""


def tracking_uri(cfg: TrackingConfig | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The configured tracking URI: ``cfg.tracking_uri``, else ``MLFLOW_TRACKING_URI``; ``None`` when off."""
    environ = os.environ if env is None else env
    return (cfg.tracking_uri if cfg else None) or environ.get("MLFLOW_TRACKING_URI") or None


def _rank(env: Mapping[str, str]) -> int:
    try:
        return int(env.get("RANK") or 0)
    except ValueError:
        return 0


def open_session(
    cfg: TrackingConfig | None = None,
    *,
    tracking_uri_override: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Session | None:
    """A session when tracking is on for this process (a URI is configured and ``RANK`` is 0), else ``None``."""
    cfg = cfg or TrackingConfig()
    environ = os.environ if env is None else env
    uri = tracking_uri_override or tracking_uri(cfg, environ)
    if not uri:
        return None
    if (rank := _rank(environ)) != 0:
        log.debug("rank %d: MLflow tracking is left to rank 0", rank)
        return None
    if not _client_installed():
        log.warning(
            "MLflow tracking at %s is configured but the MLflow client is not installed "
            "(pip install 'lmforge[tracking]'); nothing is logged, the stage goes on",
            redact_url(uri),
        )
        return None
    return Session(cfg, uri, env=environ)


def _client_installed() -> bool:
    try:
        return importlib.util.find_spec("mlflow") is not None
    except (ImportError, ValueError):  # ValueError: a module named mlflow without a spec (blocked, half-imported)
        return False


class Session:
    """A lazily created ``MlflowClient`` for one tracking URI, behind bounded retries and a one-time warning."""

    def __init__(self, cfg: TrackingConfig, uri: str, *, env: Mapping[str, str] | None = None) -> None:
        self.cfg = cfg
        self.uri = uri
        self.env = os.environ if env is None else env
        self.scrub = Scrubber(env=self.env)
        self.broken: str | None = None
        self._client: MlflowClient | None = None
        self._experiment_id: str | None = None

    @property
    def display_uri(self) -> str:
        """The tracking URI as it may be shown (a password in it replaced)."""
        return redact_url(self.uri)

    @property
    def client(self) -> MlflowClient:
        """The MLflow client (imported on first use)."""
        if self._client is None:
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        return self._client

    def experiment_id(self) -> str:
        """The experiment of the pipeline runs (see :class:`TrackingConfig.experiment`), created when missing."""
        if self._experiment_id is None:
            self._experiment_id = self._find_or_create_experiment()
        return self._experiment_id

    def _find_or_create_experiment(self) -> str:
        if not self.cfg.experiment and (given := self.env.get("MLFLOW_EXPERIMENT_ID")):
            return given
        name = self.cfg.experiment or self.env.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        found = self.call(f"get experiment {name!r}", lambda c: c.get_experiment_by_name(name))
        if found is not None:
            return found.experiment_id
        try:
            return self.call(
                f"create experiment {name!r}",
                lambda c: c.create_experiment(name),
                expected=("RESOURCE_ALREADY_EXISTS",),
            )
        except Expected:  # a concurrent stage created it first
            return self.call(f"get experiment {name!r}", lambda c: c.get_experiment_by_name(name)).experiment_id

    def search_runs(
        self, what: str, filter_string: str, *, max_results: int, order_by: list[str] | None = None
    ) -> list[Run]:
        """The active runs of the experiment that match ``filter_string`` (MLflow's search syntax), by :meth:`call`."""
        from mlflow.entities import ViewType

        experiment = self.experiment_id()
        return self.call(
            what,
            lambda c: c.search_runs(
                [experiment],
                filter_string=filter_string,
                run_view_type=ViewType.ACTIVE_ONLY,
                max_results=max_results,
                order_by=order_by,
            ),
        )

    def call(self, what: str, fn: Callable[[MlflowClient], T], *, expected: tuple[str, ...] = ()) -> T:
        """``fn(client)`` with bounded retries.

        Raises:
            Expected: MLflow answered with one of the ``expected`` error codes (the caller handles it).
            Unavailable: the call failed (reported once) or the session was already broken.
        """
        from mlflow.exceptions import MlflowException
        from requests.exceptions import RequestException

        if self.broken is not None:
            raise Unavailable(self.broken)
        attempt, wait = 1, self.cfg.backoff_s
        while True:
            try:
                with self._client_env():
                    return fn(self.client)
            except MlflowException as exc:
                if exc.error_code in expected:
                    raise Expected(exc.error_code, str(exc)) from exc
                final, reason = _permanent(exc), _reason(exc)
            except (RequestException, OSError) as exc:
                final, reason = False, f"{type(exc).__name__}: {exc}"
            if final or attempt >= self.cfg.attempts:
                tried = "not retried" if final else f"{attempt} attempt(s)"
                self.give_up(f"{what}: {reason} ({tried})")
            log.debug("MLflow %s failed (attempt %d): %s; retrying in %.2f s", what, attempt, reason, wait)
            time.sleep(wait)
            attempt, wait = attempt + 1, wait * 2

    def give_up(self, reason: str) -> NoReturn:
        """Warn once (naming the tracking URI and ``reason``), stop using the server, raise :class:`Unavailable`."""
        reason = self.scrub.text(reason)  # MLflow's messages repeat the URI, with any password in it
        self.broken = reason
        log.warning(
            "MLflow tracking at %s failed, so nothing more is logged there by this process (the stage goes on): %s",
            self.display_uri,
            reason,
        )
        raise Unavailable(reason)

    def _client_env(self) -> contextlib.AbstractContextManager[None]:
        """The MLflow client's settings for one call: no retries of its own, a short timeout, no run URLs printed."""
        return _client_env(
            {
                "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
                "MLFLOW_HTTP_REQUEST_TIMEOUT": str(self.cfg.timeout_s),
                "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
            }
        )


class _ClientEnv:
    """MLflow reads its HTTP settings from the environment at each request, so they are set around calls.

    Threads share the environment: the first call to enter saves the values it replaces and the last to leave
    restores them, so concurrent calls neither undo each other's settings nor leave them behind.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: dict[str, str | None] = {}

    @contextlib.contextmanager
    def __call__(self, settings: Mapping[str, str]) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._saved = {key: os.environ.get(key) for key in settings}
            os.environ.update(settings)
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    for key, value in self._saved.items():
                        if value is None:
                            os.environ.pop(key, None)
                        else:
                            os.environ[key] = value


_client_env = _ClientEnv()


class Expected(Exception):
    """MLflow answered with an error code the caller expects (``RESOURCE_ALREADY_EXISTS``, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _permanent(exc: Any) -> bool:
    """True for answers a retry cannot change (401/403, a rejected request); 5xx, 408, 429 and no answer are retried."""
    if exc.error_code in _PERMANENT_CODES:
        return True
    status = exc.get_http_status_code() if hasattr(exc, "get_http_status_code") else None
    found = re.search(r"error code (\d{3})", str(exc))  # answers without MLflow's JSON error body
    status = int(found.group(1)) if found else status
    return isinstance(status, int) and 400 <= status < 500 and status not in _RETRYABLE_4XX


def _reason(exc: Any) -> str:
    """One line: the error code and the first line of MLflow's message (which can carry a whole HTML page)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{exc.error_code}: {first[:300]}"
