"""Hostile requests against the real kserve ModelServer on loopback: each one is refused alone with a 4xx that names
the problem, before any work it could waste, with one log line; every well-formed request around it is answered.

The served model is the tests' tiny GPT-2 exported by the real ``export_onnx`` stage; the predictor runs as
``python -m lmforge.serve`` (what the serve image starts) with the stock ``kserve`` ``ModelServer``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from lmforge.config.serve import ServeConfig
from lmforge.serve.batcher import QueueFullError
from lmforge.serve.model_dir import resolve_served_model
from lmforge.serve.predictor import Ask, LmforgePredictor
from tests.support.serve_helpers import export_redrawn, mixed_load, serving

pytestmark = pytest.mark.slow

NAME = "tiny"
MAX_PROMPTS = 8
MAX_BYTES = 128 * 1024
ROUTES = {
    "v1": f"/v1/models/{NAME}:predict",
    "v2": f"/v2/models/{NAME}/infer",
    "openai": "/openai/v1/completions",
}
PROMPTS = ["To be, or not to be", "O Romeo", "A horse! a horse!", "Now is the winter of our discontent"]


@pytest.fixture(scope="module")
def onnx_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_redrawn(tiny_model_dir, tmp_path_factory.mktemp("hostile"))


@pytest.fixture(scope="module")
def server(onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A batching predictor with small request bounds; every route called once (first calls log a warning)."""
    log = tmp_path_factory.mktemp("hostile-log") / "server.log"
    overrides = {
        "model_name": NAME,
        "max_batch_size": 8,
        "max_wait_ms": 50.0,
        "max_queue": 64,
        "max_prompts_per_request": MAX_PROMPTS,
        "max_request_bytes": MAX_BYTES,
    }
    with serving(onnx_dir, log, overrides) as proc:
        for route in ROUTES:
            assert _post(proc.url, route, _good(route, "hi")).status_code == 200
        yield proc


def _good(route: str, prompt: str | list[str], **sampling: object) -> dict:
    prompts = prompt if isinstance(prompt, list) else [prompt]
    if route == "v1":
        return {"instances": prompts, "parameters": {"max_tokens": 3, **sampling}}
    if route == "v2":
        tensor = {"name": "text", "datatype": "BYTES", "shape": [len(prompts)], "data": prompts}
        return {"inputs": [tensor], "parameters": {"max_tokens": 3, **sampling}}
    return {"model": NAME, "prompt": prompt, "max_tokens": 3, **sampling}


def _post(url: str, route: str, body: object) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(f"{url}{ROUTES[route]}", content=content, headers=headers, timeout=60)


def _message(route: str, resp: httpx.Response) -> str:
    error = resp.json()["error"]
    return error["message"] if route == "openai" else error


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/lmforge/v1/models/{NAME}/stats", timeout=10).json()


def _log_lines(server) -> list[str]:
    return server.log_file.read_text(errors="replace").splitlines()


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"seed": -1, "temperature": 1.0}, "seed"),
        ({"seed": 2**64, "temperature": 1.0}, "seed"),
        ({"temperature": 1e-310}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_a_sampling_value_outside_the_decoders_domain_gets_400_naming_it(server, route, sampling, field) -> None:
    resp = _post(server.url, route, _good(route, "hi", **sampling))
    assert resp.status_code == 400, resp.text
    assert f"{field} must be" in _message(route, resp)


def test_one_bad_request_among_concurrent_ones_fails_alone(server) -> None:
    """Eight concurrent requests share batches (max_wait 50 ms); the one with seed -1 is refused, the rest answered."""
    bodies = [_good("openai", p) for p in PROMPTS * 2]
    bodies[3] = _good("openai", "hi", temperature=1.0, seed=-1)
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: _post(server.url, "openai", b), bodies))
    assert [a.status_code for a in answers] == [200, 200, 200, 400, 200, 200, 200, 200], [a.text for a in answers]
    assert all(len(a.json()["choices"][0]["text"]) > 0 for i, a in enumerate(answers) if i != 3)


@pytest.mark.parametrize("route", list(ROUTES))
def test_too_many_prompts_are_refused_before_any_is_generated(server, route) -> None:
    before = _stats(server.url)["requests"]
    resp = _post(server.url, route, _good(route, ["To be"] * 10_000))
    assert resp.status_code == 400, resp.text
    assert f"10000 prompts; this server takes at most {MAX_PROMPTS}" in _message(route, resp)
    assert "max_prompts_per_request" in _message(route, resp)
    assert _stats(server.url)["requests"] == before, "no prompt of a refused request is generated"
    at_most = _post(server.url, route, _good(route, PROMPTS * 2))
    assert at_most.status_code == 200, at_most.text


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_body_over_the_byte_limit_gets_413_whether_its_length_is_declared_or_not(server, route) -> None:
    body = json.dumps(_good(route, "x" * MAX_BYTES)).encode()
    resp = _post(server.url, route, body)
    assert resp.status_code == 413, resp.text
    assert f"at most {MAX_BYTES} (serve.max_request_bytes)" in _message(route, resp)
    chunked = httpx.post(
        f"{server.url}{ROUTES[route]}",
        content=(body[i : i + 4096] for i in range(0, len(body), 4096)),  # no Content-Length: chunked
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert chunked.status_code == 413, chunked.text


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"instances": ["unterminated', "not valid JSON"),
        (b"[" * 100_000, "not valid JSON"),
        (b"[" * 40 + b"]" * 40, "nests JSON deeper than 32 levels"),
    ],
    ids=["truncated", "100k-brackets", "40-levels"],
)
def test_malformed_json_gets_the_same_400_on_every_route(server, route, body, message) -> None:
    resp = _post(server.url, route, body)
    assert resp.status_code == 400, resp.text
    assert message in _message(route, resp)


def test_a_v2_body_off_the_protocol_gets_400_not_422(server) -> None:
    resp = _post(server.url, "v2", {"input": []})
    assert resp.status_code == 400, resp.text
    assert "inputs: Field required" in resp.json()["error"]


def test_a_handled_4xx_logs_one_line_and_no_traceback(server) -> None:
    before = len(_log_lines(server))
    bad = [
        ("v1", _good("v1", "")),
        ("v1", b"{"),
        ("v2", _good("v2", "hi", seed=-1, temperature=1.0)),
        ("v2", {"input": []}),
        ("openai", _good("openai", "hi", model="nope")),
        ("openai", b"[" * 100_000),
        ("openai", _good("openai", ["hi"] * 10_000)),
    ]
    for route, body in bad:
        assert 400 <= _post(server.url, route, body).status_code < 500
    new = _log_lines(server)[before:]
    assert len(new) <= len(bad), "\n".join(new)
    assert not any("Traceback" in line or "ERROR" in line for line in new), "\n".join(new)


def test_mixed_load_answers_every_good_request_and_refuses_every_hostile_one(server) -> None:
    """200 requests from 32 clients, 10 % hostile (bad sampling values, 10k-prompt bodies, malformed and deep
    JSON): every well-formed one 200, every hostile one 4xx, under 3 log lines per request."""
    before = len(_log_lines(server))
    answers = asyncio.run(
        mixed_load(server.url, PROMPTS, model=NAME, requests=200, concurrency=32, hostile_share=0.1, max_tokens=4)
    )
    assert len(answers) == 200
    hostile = [a for a in answers if a.hostile]
    assert len(hostile) == 20 and len({a.kind for a in hostile}) == 6
    assert [a for a in answers if not a.hostile and a.status != 200] == []
    assert [a for a in hostile if not 400 <= a.status < 500] == []
    lines = _log_lines(server)[before:]
    assert len(lines) < 3 * len(answers), "\n".join(lines[:50])


class _WatchedTokenizer:
    """The predictor's real tokenizer, recording each call; a call waits (at most 30 s) until ``opened`` is set."""

    def __init__(self, tokenizer, gated: bool) -> None:
        self.tokenizer = tokenizer
        self.gated = gated
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.calls: list[bool] = []  # per call: did the gate open while it waited

    def __call__(self, text: str):
        self.entered.set()
        self.calls.append(self.opened.wait(30) if self.gated else True)
        return self.tokenizer(text)

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)


def _predictor(onnx_dir: Path, **cfg: object) -> LmforgePredictor:
    predictor = LmforgePredictor(NAME, resolve_served_model(onnx_dir), ServeConfig(**cfg))
    predictor.load()
    return predictor


def test_prompts_are_tokenized_off_the_event_loop(onnx_dir) -> None:
    """The tokenizer blocks until a coroutine on the event loop opens it: only possible if the loop stays free
    while a request's prompts are tokenized (so health checks and other requests are answered meanwhile)."""
    predictor = _predictor(onnx_dir)
    watched = predictor.tokenizer = _WatchedTokenizer(predictor.tokenizer, gated=True)

    async def scenario() -> None:
        request = asyncio.create_task(predictor.complete([Ask(p, {"max_tokens": 2}) for p in PROMPTS]))
        while not watched.entered.is_set():  # the loop runs: this coroutine goes on while the tokenizer waits
            await asyncio.sleep(0.01)
        watched.opened.set()
        completions = await request
        assert [len(c.token_ids) for c in completions] == [2] * len(PROMPTS)

    try:
        asyncio.run(scenario())
    finally:
        predictor.stop()
    assert watched.calls == [True] * len(PROMPTS), "the tokenizer ran on the event loop, blocking it"


def test_a_request_that_cannot_fit_the_queue_is_refused_whole_before_any_work(onnx_dir) -> None:
    predictor = _predictor(onnx_dir, max_queue=4, max_prompts_per_request=4)
    watched = predictor.tokenizer = _WatchedTokenizer(predictor.tokenizer, gated=False)

    async def scenario() -> None:
        assert predictor.batcher is not None
        with predictor.batcher.reserve(3):  # three prompts of other requests wait
            with pytest.raises(QueueFullError, match="3 requests are waiting and this one brings 2"):
                await predictor.complete([Ask(p, {"max_tokens": 2}) for p in PROMPTS[:2]])
            assert watched.calls == [], "a refused request's prompts were tokenized"
        (one,) = await predictor.complete([Ask(PROMPTS[0], {"max_tokens": 2})])
        assert len(one.token_ids) == 2

    try:
        asyncio.run(scenario())
    finally:
        predictor.stop()
