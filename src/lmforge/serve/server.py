"""Run the lmforge predictor in the real ``kserve.ModelServer``: what ``lmforge serve`` and the serve image start.

``kserve.ModelServer`` registers the model and owns the data plane; its ``RESTServer`` serves the v1 and v2
routes, ``/metrics`` and the health checks, with lmforge's OpenAI and stats routes (:mod:`lmforge.serve.routes`)
on the same app. The departures from ``ModelServer.start``: the listening address is ``host`` (kserve always
binds 0.0.0.0, right in a pod and wrong on a laptop), gRPC is off, every request body passes
:class:`lmforge.serve.http_guard.RequestGuard` first, and the log holds one access line per request (kserve's
per-request timings and its traceback per client error are left out). One server per process: kserve serves
from one module-level FastAPI app.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from pathlib import Path

from fastapi import FastAPI

from lmforge.config.serve import ServeConfig
from lmforge.serve._kserve import FASTAPI_APP_IMPORT_STRING, ModelServer, RESTServer, app
from lmforge.serve.http_guard import RequestGuard, quiet_client_errors
from lmforge.serve.model_dir import fetch_release, resolve_served_model
from lmforge.serve.predictor import LmforgePredictor
from lmforge.serve.routes import build_router

log = logging.getLogger("lmforge.serve")


def load_predictor(path: str | Path, cfg: ServeConfig) -> LmforgePredictor:
    """The predictor for a release ``models/<name>/<version>/`` or an ONNX model directory, loaded."""
    served = resolve_served_model(path, prefer_int8=cfg.prefer_int8)
    predictor = LmforgePredictor(cfg.model_name or served.name, served, cfg)
    predictor.load()
    return predictor


def serve_model(
    path: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    cfg: ServeConfig | None = None,
    grace_period_s: int = 10,
) -> None:
    """Serve ``path`` on ``host:port`` until SIGINT/SIGTERM (blocks).

    Args:
        path: a release directory ``models/<name>/<version>/`` or an ONNX model directory, local or ``s3://`` (then
            the served ONNX folder is downloaded into a temporary directory first).
        host: address to listen on; 127.0.0.1 for a laptop, 0.0.0.0 in a pod.
        port: HTTP port.
        cfg: batching, limits and threads (default: :class:`ServeConfig` defaults).
        grace_period_s: how long a shutdown waits for requests in flight.
    """
    cfg = cfg or ServeConfig()
    with tempfile.TemporaryDirectory(prefix="lmforge-serve-") as work:
        predictor = load_predictor(fetch_release(str(path), work, prefer_int8=cfg.prefer_int8), cfg)
        _serve_until_stopped(predictor, host=host, port=port, grace_period_s=grace_period_s)


class _RESTServer(RESTServer):
    """kserve's REST server with lmforge's client-error handlers in place of kserve's."""

    def _add_exception_handlers(self, app: FastAPI) -> None:
        super()._add_exception_handlers(app)
        quiet_client_errors(app)


def _serve_until_stopped(predictor: LmforgePredictor, *, host: str, port: int, grace_period_s: int) -> None:
    server = ModelServer(http_port=port, enable_grpc=False, workers=1, grace_period=grace_period_s)
    server.register_model(predictor)
    app.include_router(build_router({predictor.name: predictor}))
    app.add_middleware(RequestGuard, max_body_bytes=predictor.cfg.max_request_bytes)
    # kserve's TimingMiddleware logs two INFO lines per request (wall and CPU time); only its warnings are kept,
    # so a request logs its one uvicorn access line.
    logging.getLogger("kserve.trace").setLevel(logging.WARNING)
    rest = _RESTServer(
        FASTAPI_APP_IMPORT_STRING,
        server.dataplane,
        server.model_repository_extension,
        port,
        grace_period=grace_period_s,
    )
    rest.config.host = host
    log.info(
        "serving %s at http://%s:%d (/v1/models/%s:predict, /v2/models/%s/infer, /openai/v1/completions)",
        predictor.name,
        host,
        port,
        predictor.name,
        predictor.name,
    )
    try:
        asyncio.run(rest.start())
    finally:
        predictor.stop()
