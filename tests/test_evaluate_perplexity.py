"""Perplexity and latency harness: exact against hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lmforge.data.shards import TokenShards
from lmforge.evaluate.latency import input_batch, latency_profile, measure_latency
from lmforge.evaluate.perplexity import (
    onnx_logits_fn,
    perplexity,
    torch_logits_fn,
    windows,
)
from lmforge.model.build import load_causal_lm


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir)


@pytest.fixture(scope="module")
def val_tokens(tiny_shards_dir) -> np.ndarray:
    return TokenShards.open(tiny_shards_dir).tokens("val")


def test_perplexity_matches_token_by_token_brute_force(tiny_model, val_tokens):
    context, max_tokens = 16, 70  # four full windows and a partial one of 6 tokens
    result = perplexity(torch_logits_fn(tiny_model), val_tokens, context=context, max_tokens=max_tokens)

    ids = np.asarray(val_tokens[:max_tokens], dtype=np.int64)
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, max_tokens, context):
            window = torch.from_numpy(ids[start : start + context])
            for t in range(1, len(window)):
                logits = tiny_model(input_ids=window[None, :t]).logits[0, -1].double()
                nll -= torch.log_softmax(logits, dim=-1)[window[t]].item()
                count += 1
    assert result.tokens == count == 4 * 15 + 5
    assert result.nll_sum == pytest.approx(nll, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert result.bits_per_token == pytest.approx(nll / count / math.log(2), rel=1e-5)


def test_uniform_logits_give_perplexity_equal_to_vocab_size():
    vocab = 512
    tokens = np.arange(1000) % vocab
    result = perplexity(lambda ids: np.zeros((*ids.shape, vocab), np.float32), tokens, context=64)
    assert result.perplexity == pytest.approx(vocab, rel=1e-12)
    assert result.mean_nll == pytest.approx(math.log(vocab), rel=1e-12)
    assert result.bits_per_token == pytest.approx(9.0, rel=1e-12)


def test_batch_size_does_not_change_perplexity(tiny_model, val_tokens):
    fn = torch_logits_fn(tiny_model)
    one = perplexity(fn, val_tokens, context=32, max_tokens=300, batch_size=1)
    many = perplexity(fn, val_tokens, context=32, max_tokens=300, batch_size=8)
    assert one.tokens == many.tokens
    assert one.nll_sum == pytest.approx(many.nll_sum, rel=1e-6)


def test_windows_are_non_overlapping_capped_and_drop_a_lone_last_token():
    tokens = np.arange(21, dtype=np.uint16)
    got = windows(tokens, context=5)
    assert [w.tolist() for w in got] == [list(range(i, i + 5)) for i in range(0, 20, 5)]  # [20] dropped
    assert all(w.dtype == np.int64 for w in got)
    capped = windows(tokens, context=5, max_tokens=12)
    assert [w.tolist() for w in capped] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]


def test_context_below_two_and_too_few_tokens_are_refused():
    with pytest.raises(ValueError, match="context"):
        windows(np.arange(10), context=1)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(lambda ids: np.zeros((*ids.shape, 4)), np.array([1]), context=4)


def test_logits_of_wrong_shape_are_refused():
    with pytest.raises(ValueError, match="shape"):
        perplexity(lambda ids: np.zeros((ids.shape[0], 4)), np.arange(10), context=4)


def test_onnx_adapter_passes_int64_ids_to_the_model():
    seen = []

    class FakeOrt:
        def logits(self, ids, attention_mask=None):
            seen.append(ids.dtype)
            return np.zeros((*ids.shape, 8), np.float32)

    result = perplexity(onnx_logits_fn(FakeOrt()), np.arange(10, dtype=np.uint16) % 8, context=5)
    assert seen and all(dtype == np.int64 for dtype in seen)
    assert result.perplexity == pytest.approx(8.0)


def test_latency_percentiles_from_a_fake_clock():
    # Each timed call takes 1, 2, ..., 10 ms: two clock readings per call.
    durations = [i * 1e-3 for i in range(1, 11)]
    readings = iter(t for d in durations for t in (0.0, d))
    calls = []
    ids = np.zeros((2, 4), np.int64)
    result = measure_latency(lambda x: calls.append(x.shape), ids, runs=10, warmup=3, clock=lambda: next(readings))
    assert len(calls) == 13
    assert result.p50_ms == pytest.approx(np.percentile(np.arange(1, 11), 50))
    assert result.p90_ms == pytest.approx(np.percentile(np.arange(1, 11), 90))
    assert result.p99_ms == pytest.approx(np.percentile(np.arange(1, 11), 99))
    assert result.mean_ms == pytest.approx(5.5)
    assert result.tokens_per_s == pytest.approx(8 / 5.5e-3)


def test_latency_profile_runs_batch_1_and_8_on_held_out_tokens():
    shapes = []
    profile = latency_profile(
        lambda ids: shapes.append(ids.shape), np.arange(20, dtype=np.uint16), context=4, runs=2, warmup=1
    )
    assert sorted(profile) == [1, 8]
    assert profile[8].batch_size == 8 and profile[8].context == 4 and profile[8].runs == 2
    assert shapes == [(1, 4)] * 3 + [(8, 4)] * 3
    batch = input_batch(np.arange(6), batch_size=2, context=4)  # too few tokens: repeated
    assert batch.tolist() == [[0, 1, 2, 3], [4, 5, 0, 1]]
