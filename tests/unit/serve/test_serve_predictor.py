"""The lmforge predictor in the real kserve ModelServer, on loopback: routes, greedy parity, batching, bad requests.

A tiny GPT-2 (tests' fixtures, its weights redrawn with a larger spread so that greedy decoding does not just
repeat one token) is exported with the real ``export_onnx`` stage; the reference output is ``transformers``
``generate(do_sample=False)`` on the same HF model, one prompt at a time.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from lmforge.config import ExportConfig
from lmforge.export.export_onnx import run as export_onnx
from lmforge.model.build import load_causal_lm, load_tokenizer
from tests.support.serve_helpers import redraw_weights, serving

pytestmark = pytest.mark.slow

PROMPTS = [
    "To be, or not to be",
    "O Romeo",
    "Now is the winter of our discontent made glorious summer by this sun of York",
    "A horse! a horse!",
]
MAX_TOKENS = 12
LIMIT = 40  # max_tokens_limit of the servers under test
NAME = "tiny"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with weights ~ N(0, 0.3²): varied greedy continuations, clear argmax margins."""
    return redraw_weights(tiny_model_dir, tmp_path_factory.mktemp("serve-model"))


@pytest.fixture(scope="module")
def onnx_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("serve") / "onnx"
    export_onnx(ExportConfig(), model=model_dir, onnx_model=out)
    return out


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> dict[str, list[int]]:
    """``transformers`` greedy tokens per prompt (EOS and what follows dropped), each prompt alone."""
    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir).eval()
    out = {}
    for prompt in PROMPTS:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        new = gen[0, ids.shape[1] :].tolist()
        out[prompt] = new[: new.index(tok.eos_token_id)] if tok.eos_token_id in new else new
    assert len({t for tokens in out.values() for t in tokens}) > 10, f"too uniform to test anything: {out}"
    return out


@pytest.fixture(scope="module")
def server(onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A predictor without dynamic batching: every request decoded alone."""
    log = tmp_path_factory.mktemp("serve-log") / "unbatched.log"
    with serving(onnx_dir, log, {"model_name": NAME, "max_batch_size": 1, "max_tokens_limit": LIMIT}) as proc:
        yield proc


def _v1(url: str, body: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/models/{NAME}:predict", json=body, timeout=60)


def _complete(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/openai/v1/completions", json={"model": NAME, **body}, timeout=60)


def test_v1_greedy_output_equals_transformers_generate(server, expected) -> None:
    for prompt in PROMPTS:
        resp = _v1(server.url, {"instances": [{"prompt": prompt, "max_tokens": MAX_TOKENS}]})
        assert resp.status_code == 200, resp.text
        (pred,) = resp.json()["predictions"]
        assert pred["token_ids"] == expected[prompt], prompt
        assert pred["finish_reason"] == ("length" if len(expected[prompt]) == MAX_TOKENS else "stop")


def test_v2_infer_answers_a_bytes_text_tensor(server, expected) -> None:
    body = {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": PROMPTS[:2]}],
        "parameters": {"max_tokens": MAX_TOKENS},
    }
    resp = httpx.post(f"{server.url}/v2/models/{NAME}/infer", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    outputs = {o["name"]: o for o in resp.json()["outputs"]}
    assert outputs["text"]["datatype"] == "BYTES" and outputs["text"]["shape"] == [2]
    counts = outputs["token_count"]["data"]
    width = outputs["token_ids"]["shape"][1]
    for i, prompt in enumerate(PROMPTS[:2]):
        row = outputs["token_ids"]["data"][i * width : (i + 1) * width]
        assert row[: counts[i]] == expected[prompt]
        assert all(t == -1 for t in row[counts[i] :])
    metadata = httpx.get(f"{server.url}/v2/models/{NAME}", timeout=10).json()
    assert metadata["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]


def test_openai_completion_and_its_stream_carry_the_same_text(server, expected) -> None:
    tok = load_tokenizer(server.model_path)
    prompt = PROMPTS[0]
    resp = _complete(server.url, {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and body["model"] == NAME
    assert body["choices"][0]["text"] == tok.decode(expected[prompt], skip_special_tokens=True)
    assert body["usage"]["completion_tokens"] == len(expected[prompt])

    with httpx.stream(
        "POST",
        f"{server.url}/openai/v1/completions",
        json={"model": NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True},
        timeout=60,
    ) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) > 2, "a stream sends the text in pieces"
    assert "".join(c["choices"][0]["text"] for c in chunks) == body["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == body["choices"][0]["finish_reason"]

    models = httpx.get(f"{server.url}/openai/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [NAME]


@pytest.mark.parametrize(
    ("route", "body", "message"),
    [
        ("v1", {"instances": [""]}, "instances[0] is empty"),
        ("v1", {"instances": [{"prompt": 5}]}, "must be a string"),
        ("v1", {"instances": [{"prompt": "hi", "max_tokens": "ten"}]}, "max_tokens must be a positive integer"),
        ("v1", {"instances": [{"prompt": "hi", "max_tokens": LIMIT + 1}]}, f"exceeds this server's limit of {LIMIT}"),
        ("v1", {"instances": [{"prompt": "hi", "colour": "red"}]}, "unknown field"),
        ("v1", {"instances": ["word " * 40], "parameters": {"max_tokens": 30}}, "exceeds the model's context of 64"),
        ("openai", {"prompt": ""}, "prompt is empty"),
        ("openai", {"prompt": "hi", "temperature": "hot"}, "temperature must be 0 (greedy) or a number"),
        ("openai", {"prompt": "hi", "max_tokens": LIMIT + 1}, f"exceeds this server's limit of {LIMIT}"),
        ("openai", {"prompt": "word " * 60, "max_tokens": 10}, "exceeds the model's context of 64"),
        ("openai", {"prompt": "x" * 5000}, "characters, far more than the model's context"),
        ("openai", {"prompt": "hi", "n": 2}, "n=2 is not supported"),
        ("v2", {"inputs": [{"name": "text", "datatype": "INT64", "shape": [1], "data": [3]}]}, "must have datatype"),
        ("v2", {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [""]}]}, "text[0] is empty"),
    ],
)
def test_bad_request_gets_400_with_a_message_and_the_server_keeps_serving(server, route, body, message) -> None:
    if route == "v1":
        resp = _v1(server.url, body)
        error = resp.json()["error"]
    elif route == "openai":
        resp = _complete(server.url, body)
        error = resp.json()["error"]["message"]
    else:
        resp = httpx.post(f"{server.url}/v2/models/{NAME}/infer", json=body, timeout=60)
        error = resp.json()["error"]
    assert resp.status_code == 400, resp.text
    assert message in error
    good = _v1(server.url, {"instances": [{"prompt": PROMPTS[1], "max_tokens": 2}]})
    assert good.status_code == 200 and len(good.json()["predictions"][0]["token_ids"]) <= 2


def test_concurrent_requests_are_batched_and_each_equals_its_unbatched_result(
    server, onnx_dir, expected, tmp_path
) -> None:
    unbatched = {
        p: _v1(server.url, {"instances": [{"prompt": p, "max_tokens": MAX_TOKENS}]}).json()["predictions"][0]
        for p in PROMPTS
    }
    # max_wait_ms 1000: the first request waits up to a second for the other three, so they share batches.
    overrides = {"model_name": NAME, "max_batch_size": len(PROMPTS), "max_wait_ms": 1000.0}
    with serving(onnx_dir, tmp_path / "batched.log", overrides) as batched:

        def ask(prompt: str) -> dict:
            resp = _v1(batched.url, {"instances": [{"prompt": prompt, "max_tokens": MAX_TOKENS}]})
            assert resp.status_code == 200, resp.text
            return resp.json()["predictions"][0]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = dict(zip(PROMPTS, pool.map(ask, PROMPTS), strict=True))
        stats = httpx.get(f"{batched.url}/lmforge/v1/models/{NAME}/stats", timeout=10).json()
    assert stats["largest_batch"] > 1, stats
    assert max(a["batch_size"] for a in answers.values()) > 1
    for prompt in PROMPTS:
        assert answers[prompt]["token_ids"] == unbatched[prompt]["token_ids"] == expected[prompt], prompt
        assert answers[prompt]["text"] == unbatched[prompt]["text"]
