"""The lmforge predictor: a ``kserve.Model`` that generates text with ONNX Runtime and the exported KV cache.

Routes (the ``kserve.ModelServer`` serves the first two; :mod:`lmforge.serve.openai` adds the third):

* REST v1 ``POST /v1/models/<name>:predict`` — ``{"instances": ["a prompt", {"prompt": "...", "max_tokens": 8}],
  "parameters": {...}}`` → ``{"predictions": [{"text", "token_ids", "finish_reason", "prompt_tokens",
  "batch_size"}]}``; an instance is a prompt or an object with ``prompt`` and sampling keys (``max_tokens``,
  ``temperature``, ``top_p``, ``seed``); ``parameters`` apply to every instance that does not set them.
* Open Inference Protocol v2 ``POST /v2/models/<name>/infer`` — input tensor ``text`` (``BYTES``, shape ``[n]``),
  sampling keys in the request ``parameters`` → outputs ``text`` (``BYTES [n]``), ``finish_reason``
  (``BYTES [n]``), ``token_ids`` (``INT64 [n, longest]``, right-padded with -1) and ``token_count`` (``INT32 [n]``).
* OpenAI ``POST /openai/v1/completions`` (with ``stream: true`` as server-sent events).

Every prompt becomes one row of the continuous batcher (:mod:`lmforge.serve.batcher`). A request is checked in this
order, each step before any work of the next: its prompt count (``serve.max_prompts_per_request``), a place in the
queue for all its prompts (else HTTP 503, nothing done), then each prompt and its sampling settings, tokenized in a
worker thread (the event loop keeps answering health checks and other requests meanwhile). A bad request raises
``kserve.errors.InvalidInput`` (HTTP 400 with the message) before anything is queued; a request whose own decoding
fails gets HTTP 500 alone, the other requests of its batch are answered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import HTTPException

from lmforge.config.serve import ServeConfig
from lmforge.errors import LmforgeError
from lmforge.model.build import load_tokenizer
from lmforge.onnx_runtime import OrtDecoderWithPast
from lmforge.serve._kserve import InferenceError, InferOutput, InferRequest, InferResponse, InvalidInput, Model
from lmforge.serve.batcher import ContinuousBatcher, DoneEvent, ErrorEvent, Event, QueueFullError, TokenEvent
from lmforge.serve.generate import GenerationRequest, RunningBatch, TokenCallback
from lmforge.serve.model_dir import ServedModel, context_length
from lmforge.serve.params import (
    SAMPLING_KEYS,
    Limits,
    RequestError,
    Sampling,
    check_length,
    check_prompt,
    check_prompt_count,
    parse_sampling,
)

log = logging.getLogger("lmforge.serve")

TEXT_INPUT = "text"


class DecodingError(LmforgeError):
    """This request's own decoding failed (HTTP 500); the other requests of its batch were answered."""


@dataclass(frozen=True)
class Ask:
    """One prompt of a request, not yet checked: the prompt, its sampling keys, and their names for messages."""

    prompt: Any
    raw: Mapping[str, Any]
    where: str = "prompt"
    params_at: str = ""


@dataclass(frozen=True)
class Completion:
    """A finished request: its text, tokens, why it stopped, its prompt length and the batch it ran in."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    batch_size: int


@dataclass(frozen=True)
class Prepared:
    """A validated prompt, tokenized, with its sampling settings."""

    prompt_ids: tuple[int, ...]
    sampling: Sampling

    def request(self) -> GenerationRequest:
        """The generation request for the batcher."""
        s = self.sampling
        return GenerationRequest(self.prompt_ids, s.max_tokens, s.temperature, s.top_p, s.seed)


class TextStream:
    """Turn tokens into text deltas, holding back a partial UTF-8 character until it is complete."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.sent = ""

    def push(self, token_id: int) -> str:
        """Add a token; the text it completes (may be empty)."""
        self.token_ids.append(token_id)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def finish(self) -> str:
        """Whatever text is still held back."""
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent = text
        return delta


class LmforgePredictor(Model):
    """Serve an lmforge ONNX model directory (see :func:`lmforge.serve.model_dir.resolve_served_model`).

    Args:
        name: model name in the routes.
        served: the model directory to serve.
        cfg: batching, limits and threads.
    """

    def __init__(self, name: str, served: ServedModel, cfg: ServeConfig) -> None:
        super().__init__(name)
        self.served = served
        self.cfg = cfg
        self.decoder: OrtDecoderWithPast | None = None
        self.tokenizer: Any = None
        self.batcher: ContinuousBatcher | None = None
        self.limits: Limits | None = None
        self.eos_token_id: int | None = None
        self.pad_token_id = 0
        # One thread tokenizes, off the event loop; calls never overlap on the one shared tokenizer object.
        self._tokenize = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmforge-tokenize")

    def load(self) -> bool:
        """Open the ONNX Runtime session and the tokenizer; set ``ready``."""
        self.decoder = OrtDecoderWithPast(self.served.path, threads=self.cfg.threads, spinning=self.cfg.ort_spinning)
        self.tokenizer = load_tokenizer(self.served.path)
        self.eos_token_id = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else (self.eos_token_id or 0))
        self.limits = Limits(
            context=context_length(self.served.path),
            max_tokens_limit=self.cfg.max_tokens_limit,
            default_max_tokens=self.cfg.default_max_tokens,
            default_temperature=self.cfg.default_temperature,
            max_prompts=self.cfg.max_prompts_per_request,
        )
        self.batcher = ContinuousBatcher(
            self._new_batch,
            max_batch_size=self.cfg.max_batch_size,
            max_wait_ms=self.cfg.max_wait_ms,
            max_queue=self.cfg.max_queue,
        )
        log.info(
            "%s: %s (%s; context %d, max batch %d, max wait %g ms)",
            self.name,
            self.served.path,
            self.served.reason,
            self.limits.context,
            self.cfg.max_batch_size,
            self.cfg.max_wait_ms,
        )
        self.ready = True
        return self.ready

    def stop(self) -> None:
        """Stop the batcher."""
        if self.batcher is not None:
            self.batcher.close()
        self._tokenize.shutdown(wait=False, cancel_futures=True)
        super().stop()

    def _new_batch(self, on_token: TokenCallback) -> RunningBatch:
        assert self.decoder is not None
        return RunningBatch(
            self.decoder, eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id, on_token=on_token
        )

    # ---- requests -------------------------------------------------------------------------------------------

    def prepare(self, ask: Ask) -> Prepared:
        """Validate and tokenize one prompt with its sampling keys; raise :class:`RequestError` if invalid."""
        assert self.limits is not None
        text = check_prompt(ask.prompt, self.limits, ask.where)
        sampling = parse_sampling(ask.raw, self.limits, where=ask.params_at)
        ids = tuple(int(i) for i in self.tokenizer(text)["input_ids"])
        check_length(len(ids), sampling, self.limits, ask.where)
        return Prepared(ids, sampling)

    async def submit(
        self, asks: Sequence[Ask], *, stream: bool = False, where: str = "prompt"
    ) -> list[tuple[Prepared, asyncio.Queue[Event]]]:
        """Check, tokenize and queue every prompt of one request; each one's events arrive on its queue (token
        events only if ``stream``).

        Raises :class:`RequestError` for too many prompts or a bad one, :class:`QueueFullError` when the queue
        cannot take them all; either way nothing is queued.
        """
        assert self.batcher is not None and self.limits is not None
        check_prompt_count(len(asks), self.limits, where)
        with self.batcher.reserve(len(asks)) as places:
            loop = asyncio.get_running_loop()
            prepared = await loop.run_in_executor(self._tokenize, lambda: [self.prepare(a) for a in asks])
            return [(p, places.submit(p.request(), stream=stream)) for p in prepared]

    async def complete(self, asks: Sequence[Ask], where: str = "prompt") -> list[Completion]:
        """Generate every prompt of one request (queued together, so they may share batches); results in order."""
        queued = await self.submit(asks, where=where)
        results = await asyncio.gather(*(_finished(q) for _, q in queued))
        return [
            Completion(
                text=self.tokenizer.decode(done.result.token_ids, skip_special_tokens=True),
                token_ids=list(done.result.token_ids),
                finish_reason=done.result.finish_reason,
                prompt_tokens=len(p.prompt_ids),
                batch_size=done.batch_size,
            )
            for (p, _), done in zip(queued, results, strict=True)
        ]

    async def stream(self, events: asyncio.Queue[Event]) -> AsyncIterator[tuple[str, DoneEvent | None]]:
        """Text deltas of one queued prompt (see :meth:`submit` with ``stream``) as its tokens arrive; the last
        item carries the :class:`DoneEvent`."""
        stream = TextStream(self.tokenizer)
        while True:
            event = await events.get()
            if isinstance(event, TokenEvent):
                if delta := stream.push(event.token_id):
                    yield delta, None
            elif isinstance(event, DoneEvent):
                yield stream.finish(), event
                return
            else:
                raise _decoding_error(event)

    # ---- kserve handlers ------------------------------------------------------------------------------------

    async def predict(
        self, payload: dict[str, Any] | InferRequest, headers: dict[str, str] | None = None
    ) -> dict[str, Any] | InferResponse:
        """Answer a v1 ``instances`` body or a v2 ``InferRequest``."""
        try:
            if isinstance(payload, InferRequest):
                return await self._predict_v2(payload)
            return await self._predict_v1(payload)
        except RequestError as exc:
            raise InvalidInput(str(exc)) from exc
        except QueueFullError as exc:
            raise HTTPException(status_code=503, detail=str(exc)) from exc
        except DecodingError as exc:
            raise InferenceError(str(exc)) from exc

    async def _predict_v1(self, payload: Any) -> dict[str, Any]:
        if isinstance(payload, bytes):
            raise RequestError("the request body must be JSON sent with Content-Type: application/json")
        if not isinstance(payload, dict):
            raise RequestError(f"the request body must be a JSON object, got {type(payload).__name__}")
        if unknown := sorted(set(payload) - {"instances", "parameters"}):
            raise RequestError(f"unknown field(s) {unknown}; a v1 request has 'instances' and 'parameters'")
        instances, defaults = payload.get("instances"), payload.get("parameters") or {}
        if not isinstance(instances, list) or not instances:
            raise RequestError("'instances' must be a non-empty list of prompts")
        if not isinstance(defaults, dict) or set(defaults) - set(SAMPLING_KEYS):
            raise RequestError(f"'parameters' must be an object with keys among {list(SAMPLING_KEYS)}")
        check_prompt_count(len(instances), self.limits, "instances")
        asks = []
        for i, instance in enumerate(instances):
            where = f"instances[{i}]"
            if isinstance(instance, dict):
                if unknown := sorted(set(instance) - {"prompt", *SAMPLING_KEYS}):
                    raise RequestError(f"{where}: unknown field(s) {unknown}")
                asks.append(Ask(instance.get("prompt"), {**defaults, **instance}, f"{where}.prompt", where))
            else:
                asks.append(Ask(instance, defaults, where, "parameters"))
        completions = await self.complete(asks, "instances")
        return {
            "predictions": [
                {
                    "text": c.text,
                    "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason,
                    "prompt_tokens": c.prompt_tokens,
                    "batch_size": c.batch_size,
                }
                for c in completions
            ]
        }

    async def _predict_v2(self, request: InferRequest) -> InferResponse:
        if [i.name for i in request.inputs] != [TEXT_INPUT]:
            raise RequestError(
                f"expected one input tensor named '{TEXT_INPUT}', got {[i.name for i in request.inputs]}"
            )
        tensor = request.inputs[0]
        if tensor.datatype != "BYTES":
            raise RequestError(f"input '{TEXT_INPUT}' must have datatype BYTES, got {tensor.datatype}")
        assert self.limits is not None
        check_prompt_count(int(np.prod(tensor.shape)), self.limits, f"input '{TEXT_INPUT}'")
        try:
            values = tensor.as_numpy().reshape(-1).tolist()
        except ValueError as exc:
            raise RequestError(f"input '{TEXT_INPUT}': data does not match shape {tensor.shape}: {exc}") from exc
        params = dict(request.parameters or {})
        raw = {k: params[k] for k in SAMPLING_KEYS if k in params}
        asks = [
            Ask(_text(v, f"{TEXT_INPUT}[{i}]"), raw, f"{TEXT_INPUT}[{i}]", "parameters") for i, v in enumerate(values)
        ]
        completions = await self.complete(asks, f"input '{TEXT_INPUT}'")
        longest = max(len(c.token_ids) for c in completions)
        ids = np.full((len(completions), longest), -1, dtype=np.int64)
        for i, c in enumerate(completions):
            ids[i, : len(c.token_ids)] = c.token_ids
        outputs = [
            _output("text", np.array([c.text for c in completions], dtype=np.object_), "BYTES"),
            _output("finish_reason", np.array([c.finish_reason for c in completions], dtype=np.object_), "BYTES"),
            _output("token_ids", ids, "INT64"),
            _output("token_count", np.array([len(c.token_ids) for c in completions], dtype=np.int32), "INT32"),
        ]
        return InferResponse(request.id or str(uuid.uuid4()), self.name, outputs, parameters={})

    def get_input_types(self) -> list[dict[str, Any]]:
        """v2 model metadata: one BYTES tensor of prompts."""
        return [{"name": TEXT_INPUT, "datatype": "BYTES", "shape": [-1]}]

    def get_output_types(self) -> list[dict[str, Any]]:
        """v2 model metadata: the generated text and tokens."""
        return [
            {"name": "text", "datatype": "BYTES", "shape": [-1]},
            {"name": "finish_reason", "datatype": "BYTES", "shape": [-1]},
            {"name": "token_ids", "datatype": "INT64", "shape": [-1, -1]},
            {"name": "token_count", "datatype": "INT32", "shape": [-1]},
        ]

    def stats(self) -> dict[str, Any]:
        """Batching counters (how many batches of each size ran) and the serving settings."""
        assert self.batcher is not None and self.limits is not None
        return {
            "model": self.name,
            "served": str(self.served.path),
            "artifact": self.served.artifact,
            "context": self.limits.context,
            "max_batch_size": self.cfg.max_batch_size,
            "max_wait_ms": self.cfg.max_wait_ms,
            **self.batcher.stats.as_dict(),
        }


async def _finished(events: asyncio.Queue[Event]) -> DoneEvent:
    while True:
        event = await events.get()
        if isinstance(event, DoneEvent):
            return event
        if isinstance(event, ErrorEvent):
            raise _decoding_error(event)


def _decoding_error(event: ErrorEvent) -> DecodingError:
    error = DecodingError(f"decoding this request failed: {type(event.error).__name__}: {event.error}")
    error.__cause__ = event.error
    return error


def _text(value: Any, where: str) -> Any:
    """A v2 BYTES element as text (the binary extension hands bytes); other values go to the prompt check."""
    if not isinstance(value, bytes):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"{where} is not UTF-8 text: {exc.reason} at byte {exc.start}", "prompt") from exc


def _output(name: str, data: np.ndarray, datatype: str) -> InferOutput:
    out = InferOutput(name, list(data.shape), datatype)
    out.set_data_from_numpy(data, binary_data=False)
    return out
