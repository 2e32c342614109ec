"""What the HTTP server checks before any route sees a request body, and how it answers a client's mistake.

:class:`RequestGuard` (ASGI middleware) reads the body of every request that has one, before routing:

* more than ``max_body_bytes`` (``serve.max_request_bytes``) → 413, refused on its ``Content-Length`` before it
  is read, else as soon as the bytes read pass the limit;
* a JSON body (no content type, or one ending in ``json``) that does not parse, or nests deeper than
  :data:`MAX_JSON_DEPTH` → 400.

So every route answers malformed JSON the same way (HTTP 400), in its protocol's error shape: OpenAI's
``{"error": {"message", "type", "param", "code"}}`` under ``/openai/``, KServe's ``{"error": message}`` elsewhere.
:func:`quiet_client_errors` answers the 4xx that kserve raises with one access-log line and no traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lmforge.serve._kserve import InferenceError, InvalidInput, ModelNotFound
from lmforge.serve.params import RequestError

log = logging.getLogger("lmforge.serve")

# No request of these routes nests deeper than 4 levels; 32 leaves room and keeps every JSON parser (the standard
# library's recursive one included) far from its recursion limit.
MAX_JSON_DEPTH = 32
OPENAI_PATH_PREFIX = "/openai/"


def openai_error(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict[str, Any]:
    """The body of an OpenAI API error."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def parse_json(body: bytes) -> Any:
    """The JSON value of a request body; :class:`RequestError` if it does not parse or nests too deep."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from exc
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RequestError(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return value


class RequestGuard:
    """ASGI middleware: bound the body size and check JSON before the app (see the module's docstring)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            body = await self._read(headers, receive)
            if _is_json(headers.get("content-type")):
                parse_json(body)
        except _TooLarge as exc:
            await _refuse(scope, send, 413, str(exc))
            return
        except RequestError as exc:
            await _refuse(scope, send, 400, str(exc))
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, headers: dict[str, str], receive: Receive) -> bytes:
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _TooLarge(self._message(int(declared)))
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _TooLarge(self._message(size, at_least=True))
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)

    def _message(self, size: int, *, at_least: bool = False) -> str:
        return (
            f"the request body has {'more than ' if at_least else ''}{size} bytes; this server takes at most "
            f"{self.max_body_bytes} (serve.max_request_bytes): send fewer or shorter prompts per request"
        )


class _TooLarge(Exception):
    pass


def _is_json(content_type: str | None) -> bool:
    return content_type is None or content_type.split(";")[0].strip().lower().endswith("json")


async def _refuse(scope: Scope, send: Send, status: int, message: str) -> None:
    log.debug("refused %s %s with %d: %s", scope["method"], scope["path"], status, message)
    content = openai_error(message) if scope["path"].startswith(OPENAI_PATH_PREFIX) else {"error": message}
    payload = orjson.dumps(content)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


Handler = Callable[[Request, Exception], Coroutine[Any, Any, JSONResponse]]


def _answer(status: int, level: int) -> Handler:
    async def handler(request: Request, exc: Exception) -> JSONResponse:
        log.log(level, "%s %s: %d %s", request.method, request.url.path, status, exc)
        return JSONResponse(status_code=status, content={"error": str(exc)})

    return handler


async def _invalid_body(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
    log.debug("%s %s: 400 %s", request.method, request.url.path, problems)
    return JSONResponse(status_code=400, content={"error": f"the request body does not fit the protocol: {problems}"})


def quiet_client_errors(app: FastAPI) -> None:
    """Answer kserve's client errors (400, 404, and a v2 body that does not fit the protocol) with no log line of
    their own (the access log has one), and a failed inference (500) with one line, where kserve logs a traceback.

    Call it after kserve registered its handlers (``RESTServer._add_exception_handlers``): these replace them.
    """
    app.add_exception_handler(InvalidInput, _answer(400, logging.DEBUG))
    app.add_exception_handler(ModelNotFound, _answer(404, logging.DEBUG))
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(InferenceError, _answer(500, logging.ERROR))
