"""Routes lmforge adds to the ``kserve.ModelServer`` app: OpenAI completions and the batching counters.

KServe's own OpenAI layer (``kserve.protocol.rest.openai``) imports its request and response types from vLLM,
which is not installable next to this project's CPU PyTorch; so ``/openai/v1/completions`` is served here, on the
same path and with the request and response fields of OpenAI's completions API (the ones KServe's layer accepts):

* ``POST /openai/v1/completions`` — ``{"model", "prompt": str | [str], "max_tokens", "temperature", "top_p",
  "seed", "stream"}``; with ``"stream": true`` the answer is server-sent events, one ``text_completion`` chunk
  per text delta, then a chunk with ``finish_reason``, then ``data: [DONE]``. Fields of the API that this
  predictor does not implement (``n`` > 1, ``stop``, ``logprobs``, ``echo``, penalties, ...) are refused with 400.
* ``GET /openai/v1/models`` — the served models.
* ``GET /lmforge/v1/models/<name>/stats`` — how many batches of each size ran (dynamic batching at work).

Errors have OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` (400 bad request, 404 unknown
model, 413 body too large, 500 this request's decoding failed, 503 queue full).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from lmforge.serve.batcher import Event, QueueFullError
from lmforge.serve.http_guard import openai_error, parse_json
from lmforge.serve.params import SAMPLING_KEYS, RequestError, check_prompt_count
from lmforge.serve.predictor import Ask, DecodingError, LmforgePredictor

OPENAI_PREFIX = "/openai/v1"
STATS_PATH = "/lmforge/v1/models/{model_name}/stats"
ACCEPTED = {"model", "prompt", "stream", "user", *SAMPLING_KEYS}
# OpenAI completion fields this predictor does not implement, with the value that means "not used".
UNSUPPORTED = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "logprobs": None,
    "stop": None,
    "suffix": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
    "stream_options": None,
}


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content=openai_error(message, param, kind))


def _parse_body(body: Any) -> tuple[str, list[Any], dict[str, Any], bool]:
    """``(model, prompts, sampling keys, stream)`` of a completions request; raise :class:`RequestError`."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    if unknown := sorted(set(body) - ACCEPTED - set(UNSUPPORTED)):
        raise RequestError(f"unknown field(s) {unknown}", unknown[0])
    for key, unused in UNSUPPORTED.items():
        if key in body and body[key] != unused:
            raise RequestError(f"{key}={body[key]!r} is not supported by the lmforge predictor", key)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model must be the name of a served model", "model")
    prompt = body.get("prompt")
    prompts = prompt if isinstance(prompt, list) else [prompt]
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r}", "stream")
    return model, prompts, {k: body[k] for k in SAMPLING_KEYS if k in body}, stream


def _chunk(cid: str, created: int, model: str, index: int, text: str, finish: str | None) -> str:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
    body = {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    return f"data: {json.dumps(body)}\n\n"


async def _events(
    predictor: LmforgePredictor, queues: list[asyncio.Queue[Event]], cid: str, created: int
) -> AsyncIterator[str]:
    """Server-sent events of every prompt's deltas, interleaved as they arrive, then ``[DONE]``."""
    merged: asyncio.Queue[tuple[int, str, str | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, events: asyncio.Queue[Event]) -> None:
        try:
            async for delta, done in predictor.stream(events):
                finish = done.result.finish_reason if done is not None else None
                if delta or finish:
                    await merged.put((index, delta, finish, None))
        except Exception as exc:  # reported to the client as an error event; the stream then ends
            await merged.put((index, "", None, exc))

    tasks = [asyncio.create_task(pump(i, q)) for i, q in enumerate(queues)]
    try:
        left = len(tasks)
        while left:
            index, delta, finish, error = await merged.get()
            if error is not None:
                message = {"error": {"message": str(error), "type": type(error).__name__, "param": None, "code": None}}
                yield f"data: {json.dumps(message)}\n\n"
                return
            yield _chunk(cid, created, predictor.name, index, delta, finish)
            left -= finish is not None
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()


def build_router(models: Mapping[str, LmforgePredictor]) -> APIRouter:
    """The OpenAI completions, models and stats routes for ``models`` (by route name)."""
    router = APIRouter()
    started = int(time.time())

    @router.post(f"{OPENAI_PREFIX}/completions")
    async def completions(request: Request) -> Any:
        try:
            name, prompts, raw, stream = _parse_body(parse_json(await request.body()))
            predictor = models.get(name)
            if predictor is None:
                return _error(404, f"model {name!r} is not served here (models: {sorted(models)})", "model")
            assert predictor.limits is not None
            check_prompt_count(len(prompts), predictor.limits, "the prompt list")
            where = "prompt" if len(prompts) == 1 else "prompt[{}]"
            asks = [Ask(p, raw, where.format(i)) for i, p in enumerate(prompts)]
            cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
            if stream:
                queued = await predictor.submit(asks, stream=True, where="the prompt list")
                events = _events(predictor, [q for _, q in queued], cid, created)
                return StreamingResponse(events, media_type="text/event-stream")
            completed = await predictor.complete(asks, "the prompt list")
        except RequestError as exc:
            return _error(400, str(exc), exc.param)
        except QueueFullError as exc:
            return _error(503, str(exc), kind="server_busy")
        except DecodingError as exc:
            return _error(500, str(exc), kind="server_error")
        prompt_tokens = sum(c.prompt_tokens for c in completed)
        completion_tokens = sum(len(c.token_ids) for c in completed)
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": name,
            "choices": [
                {"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                for i, c in enumerate(completed)
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    @router.get(f"{OPENAI_PREFIX}/models")
    async def list_models() -> dict[str, Any]:
        data = [{"id": name, "object": "model", "created": started, "owned_by": "lmforge"} for name in sorted(models)]
        return {"object": "list", "data": data}

    @router.get(STATS_PATH)
    async def stats(model_name: str) -> Any:
        predictor = models.get(model_name)
        if predictor is None:
            return _error(404, f"model {model_name!r} is not served here", "model_name")
        return predictor.stats()

    return router
