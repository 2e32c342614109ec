"""Batched KV-cache decoding, the dynamic batcher and the choice of the served model, without a server."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from lmforge.artifacts import write_manifest
from lmforge.config import ServeConfig
from lmforge.errors import InputDataError
from lmforge.onnx_runtime import WITH_PAST_FILE, OrtDecoderWithPast, cache_arrays
from lmforge.serve.batcher import DoneEvent, DynamicBatcher, ErrorEvent, QueueFullError, TokenEvent
from lmforge.serve.generate import GenerationRequest, drop_rows, generate_batch, left_padded
from lmforge.serve.model_dir import resolve_served_model
from lmforge.serve.predictor import LmforgePredictor
from tests.support.serve_helpers import export_redrawn

pytestmark = pytest.mark.slow

PROMPTS = [(5, 17, 99, 3), (42,), (7, 7, 7, 7, 7, 7, 7, 8, 9), (300, 301)]


@pytest.fixture(scope="module")
def onnx_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_redrawn(tiny_model_dir, tmp_path_factory.mktemp("gen"))


@pytest.fixture(scope="module")
def decoder(onnx_dir: Path) -> OrtDecoderWithPast:
    return OrtDecoderWithPast(onnx_dir)


def _alone(decoder: OrtDecoderWithPast, request: GenerationRequest) -> list[int]:
    (result,) = generate_batch(decoder, [request], eos_token_id=None, pad_token_id=1)
    return result.token_ids


def test_each_row_of_a_batch_decodes_as_if_alone_even_as_rows_finish_early(decoder) -> None:
    requests = [GenerationRequest(p, max_tokens=n) for p, n in zip(PROMPTS, (9, 2, 6, 1), strict=True)]
    seen: list[tuple[int, int]] = []
    results = generate_batch(
        decoder, requests, eos_token_id=None, pad_token_id=1, on_token=lambda r, t: seen.append((r, t))
    )
    for request, result in zip(requests, results, strict=True):
        assert result.token_ids == _alone(decoder, request)
        assert len(result.token_ids) == request.max_tokens and result.finish_reason == "length"
    for row, result in enumerate(results):  # the callback saw every token, in order
        assert [t for r, t in seen if r == row] == result.token_ids


def test_greedy_batch_matches_the_shared_ort_generate(decoder) -> None:
    ids = np.array([[5, 17, 99, 3]], dtype=np.int64)
    reference = decoder.generate(ids, max_new_tokens=8, pad_token_id=1)[0].tolist()
    (result,) = generate_batch(decoder, [GenerationRequest(PROMPTS[0], 8)], eos_token_id=None, pad_token_id=1)
    assert result.token_ids == reference


def test_eos_stops_a_row_and_is_not_returned(decoder) -> None:
    greedy = _alone(decoder, GenerationRequest(PROMPTS[2], 6))
    eos = greedy[3]
    (result,) = generate_batch(decoder, [GenerationRequest(PROMPTS[2], 6)], eos_token_id=eos, pad_token_id=1)
    assert result.token_ids == greedy[: greedy.index(eos)]
    assert result.finish_reason == "stop"


def test_sampling_is_reproducible_by_seed_and_a_tiny_top_p_is_greedy(decoder) -> None:
    sample = GenerationRequest(PROMPTS[0], 10, temperature=1.5, seed=7)
    assert _alone(decoder, sample) == _alone(decoder, sample)
    assert _alone(decoder, sample) != _alone(decoder, GenerationRequest(PROMPTS[0], 10))
    nucleus = GenerationRequest(PROMPTS[0], 10, temperature=1.5, top_p=1e-9, seed=7)
    assert _alone(decoder, nucleus) == _alone(decoder, GenerationRequest(PROMPTS[0], 10))


def test_batcher_runs_requests_queued_together_as_one_batch_up_to_its_size(decoder) -> None:
    def run(requests, on_token):
        return generate_batch(decoder, requests, eos_token_id=None, pad_token_id=1, on_token=on_token)

    async def scenario(max_batch_size: int) -> tuple[dict, list[list[int]], list[int]]:
        batcher = DynamicBatcher(run, max_batch_size=max_batch_size, max_wait_ms=50.0, max_queue=8)
        queues = [batcher.submit(GenerationRequest(p, 4), stream=True) for p in PROMPTS[:3]]
        tokens, sizes = [], []
        for queue in queues:
            row = []
            while not isinstance(event := await queue.get(), DoneEvent):
                assert isinstance(event, TokenEvent)
                row.append(event.token_id)
            assert row == event.result.token_ids  # streamed tokens = the result
            tokens.append(row)
            sizes.append(event.batch_size)
        batcher.close()
        return batcher.stats.as_dict(), tokens, sizes

    stats, tokens, sizes = asyncio.run(scenario(8))
    assert stats["batch_sizes"] == {"3": 1} and sizes == [3, 3, 3]
    assert tokens == [_alone(decoder, GenerationRequest(p, 4)) for p in PROMPTS[:3]]
    stats, _, sizes = asyncio.run(scenario(2))
    assert stats["batch_sizes"] == {"1": 1, "2": 1} and sizes == [2, 2, 1]


def test_batcher_refuses_requests_beyond_its_queue() -> None:
    async def scenario() -> None:
        batcher = DynamicBatcher(lambda r, cb: [], max_batch_size=1, max_wait_ms=0.0, max_queue=2)
        batcher.submit(GenerationRequest((1,), 1))
        batcher.submit(GenerationRequest((1,), 1))
        with pytest.raises(QueueFullError, match="2 requests are waiting"):
            batcher.submit(GenerationRequest((1,), 1))
        batcher.close()

    asyncio.run(scenario())


def test_a_request_whose_own_decoding_fails_fails_alone_in_its_batch(decoder) -> None:
    """Requests that bypass the predictor's checks (seed -1: numpy refuses it; temperature 1e-310: the tempered
    logits overflow and the probabilities are NaN) fail in decoding; the other rows of their batch decode as if
    alone, and the batcher gives each request its own outcome."""
    good = [GenerationRequest(PROMPTS[0], 5), GenerationRequest(PROMPTS[2], 5, temperature=1.2, seed=3)]
    bad = [
        GenerationRequest(PROMPTS[1], 5, temperature=1.0, seed=-1),
        GenerationRequest(PROMPTS[3], 5, temperature=1e-310, seed=1),
    ]
    batch = [good[0], bad[0], good[1], bad[1]]
    results = generate_batch(decoder, batch, eos_token_id=None, pad_token_id=1)
    assert [r.finish_reason for r in results] == ["length", "error", "length", "error"]
    assert "non-negative" in str(results[1].error) and "NaN" in str(results[3].error)
    assert results[0].token_ids == _alone(decoder, good[0]) and results[2].token_ids == _alone(decoder, good[1])

    def run(requests, on_token):
        return generate_batch(decoder, requests, eos_token_id=None, pad_token_id=1, on_token=on_token)

    async def scenario() -> list:
        batcher = DynamicBatcher(run, max_batch_size=4, max_wait_ms=50.0, max_queue=8)
        queues = [batcher.submit(r) for r in batch]
        events = [await q.get() for q in queues]
        batcher.close()
        return events

    events = asyncio.run(scenario())
    assert [type(e) for e in events] == [DoneEvent, ErrorEvent, DoneEvent, ErrorEvent]
    assert events[0].batch_size == 4 and events[0].result.token_ids == results[0].token_ids


def test_batcher_reserves_places_for_all_prompts_of_a_request_or_refuses_it_whole() -> None:
    async def scenario() -> None:
        batcher = DynamicBatcher(lambda r, cb: [], max_batch_size=1, max_wait_ms=0.0, max_queue=4)
        batcher.submit(GenerationRequest((1,), 1))
        with batcher.reserve(2) as places:
            with pytest.raises(QueueFullError, match="3 requests are waiting and this one brings"), batcher.reserve(2):
                pass
            places.submit(GenerationRequest((1,), 1))
        # the place the reservation still held is free again: one waits, one was submitted, two are free
        with batcher.reserve(2):
            pass
        batcher.close()

    asyncio.run(scenario())


class _Gated:
    """A decoder whose second run waits for ``gate``: the first request is mid-decode when the next one arrives."""

    def __init__(self, decoder: OrtDecoderWithPast, gate: threading.Event) -> None:
        self.decoder, self.gate, self.runs = decoder, gate, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.decoder, name)

    def _wait(self) -> None:
        self.runs += 1
        if self.runs == 2:
            self.gate.wait(timeout=60)  # a safety valve only: the test sets the gate at once

    def step(self, *args: object) -> tuple[np.ndarray, list]:
        self._wait()
        return self.decoder.step(*args)

    def step_bound(self, *args: object) -> tuple[np.ndarray, list]:
        self._wait()
        return self.decoder.step_bound(*args)


def test_a_short_request_joins_a_running_long_one_and_finishes_first(onnx_dir, decoder) -> None:
    long, short = GenerationRequest(PROMPTS[0], 40), GenerationRequest(PROMPTS[1], 2)

    async def scenario() -> tuple[list[str], dict[str, DoneEvent]]:
        predictor = LmforgePredictor("tiny", resolve_served_model(onnx_dir), ServeConfig(max_wait_ms=0.0))
        predictor.load()
        gate = threading.Event()
        predictor.decoder = _Gated(predictor.decoder, gate)
        order: list[str] = []
        done: dict[str, DoneEvent] = {}

        async def finish(name: str, queue: asyncio.Queue) -> None:
            while not isinstance(event := await queue.get(), DoneEvent):
                assert isinstance(event, TokenEvent)
            order.append(name)
            done[name] = event

        long_events = predictor.batcher.submit(long, stream=True)
        assert isinstance(await long_events.get(), TokenEvent)  # the long request is decoding
        short_events = predictor.batcher.submit(short)
        gate.set()
        await asyncio.gather(finish("long", long_events), finish("short", short_events))
        predictor.stop()
        return order, done

    order, done = asyncio.run(scenario())
    assert order == ["short", "long"]
    assert done["short"].result.token_ids == _alone(decoder, short)
    assert done["long"].result.token_ids == _alone(decoder, long)
    assert done["short"].batch_size == 2


def _release(root: Path, onnx_dir: Path, artifacts: list[str], withheld: dict[str, str]) -> Path:
    release = root / "models" / "demo" / "v1"
    for name in artifacts:
        shutil.copytree(onnx_dir, release / name)
    manifest = {
        "kind": "release",
        "model_name": "demo",
        "version": "v1",
        "artifacts": {name: {"kind": "onnx-model"} for name in artifacts},
        "withheld": withheld,
    }
    (release / "manifest.json").write_text(json.dumps(manifest))
    return release


def test_a_release_serves_int8_when_it_has_it_else_fp32(onnx_dir, tmp_path) -> None:
    both = _release(tmp_path / "a", onnx_dir, ["student", "onnx_fp32", "int8_dynamic"], {})
    served = resolve_served_model(both)
    assert (served.artifact, served.name, served.version) == ("int8_dynamic", "demo", "v1")
    assert resolve_served_model(both, prefer_int8=False).artifact == "onnx_fp32"
    fp32 = _release(tmp_path / "b", onnx_dir, ["onnx_fp32"], {"int8_dynamic": "rejected: delta +9%"})
    served = resolve_served_model(fp32)
    assert served.artifact == "onnx_fp32" and "rejected: delta +9%" in served.reason
    assert resolve_served_model(onnx_dir).path == onnx_dir


def test_a_directory_without_the_kv_cache_graph_is_refused(onnx_dir, tmp_path) -> None:
    plain = tmp_path / "plain"
    shutil.copytree(onnx_dir, plain, ignore=shutil.ignore_patterns(f"{WITH_PAST_FILE}*"))
    write_manifest(plain, "onnx-model")
    with pytest.raises(InputDataError, match=f"no {WITH_PAST_FILE}"):
        resolve_served_model(plain)
    student_only = _release(tmp_path / "c", plain, ["student"], {})
    with pytest.raises(InputDataError, match="no servable ONNX model"):
        resolve_served_model(student_only)


def test_left_padding_puts_each_prompt_at_the_end_of_its_row_with_mask_1_on_it_only() -> None:
    ids, mask = left_padded([GenerationRequest((5, 6, 7), 1), GenerationRequest((9,), 1)], pad_token_id=0)
    np.testing.assert_array_equal(ids, [[5, 6, 7], [0, 0, 9]])
    np.testing.assert_array_equal(mask, [[1, 1, 1], [0, 0, 1]])
    assert ids.dtype == mask.dtype == np.int64


def test_dropping_rows_trims_the_columns_that_are_padding_in_every_row_left() -> None:
    mask = np.array([[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]])
    past = [np.arange(3 * 2 * 4).reshape(3, 1, 4, 2)]  # [batch, heads, positions, head_dim]
    tokens, kept_mask, kept_past = drop_rows([1, 2], np.array([10, 11, 12]), mask, past)
    np.testing.assert_array_equal(tokens, [11, 12])
    np.testing.assert_array_equal(kept_mask, [[1, 1], [0, 1]])
    np.testing.assert_array_equal(kept_past[0], past[0][1:, :, 2:])
    _, untrimmed, _ = drop_rows([0, 2], np.array([10, 11, 12]), mask, past)
    np.testing.assert_array_equal(untrimmed, mask[[0, 2]])


def test_a_bound_step_gives_the_logits_and_cache_of_a_plain_step(decoder) -> None:
    ids, mask = left_padded([GenerationRequest(p, 1) for p in PROMPTS], pad_token_id=1)
    logits, past = decoder.step(ids, mask, decoder.empty_past(len(PROMPTS)))
    bound_logits, bound_past = decoder.step_bound(ids, mask, decoder.empty_past(len(PROMPTS)))
    np.testing.assert_array_equal(bound_logits, logits)
    mask = np.concatenate([mask, np.ones((len(PROMPTS), 1), dtype=np.int64)], axis=1)
    token = logits[:, -1:].argmax(-1)
    logits, past = decoder.step(token, mask, past)
    bound_logits, bound_past = decoder.step_bound(token, mask, bound_past)  # the cache fed back as OrtValues
    np.testing.assert_array_equal(bound_logits, logits)
    for bound, plain in zip(cache_arrays(bound_past), past, strict=True):
        np.testing.assert_array_equal(bound, plain)
