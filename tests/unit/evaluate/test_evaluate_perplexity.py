"""Perplexity and latency harness: exact against hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lmforge.formats.token_shards import TokenShards
from lmforge.metrics.latency import input_batch, latency_profile, measure_latency
from lmforge.metrics.perplexity import (
    onnx_logits_fn,
    perplexity,
    scored_bytes,
    scored_ids,
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


def _brute_force(model, ids: np.ndarray, *, context: int, stride: int) -> tuple[float, int]:
    """Token by token, no cache: target ``t`` conditioned on the window the method assigns it to.

    Written from the definition (pass ends at ``min(context + k·stride, n - 1)``, each feeding the
    ``context`` tokens before its end), not from the implementation's window list.
    """
    last = ids.size - 1
    ends = [min(context, last)]
    while ends[-1] < last:
        ends.append(min(ends[-1] + stride, last))
    nll, count = 0.0, 0
    with torch.no_grad():
        for t in range(1, last + 1):
            end = next(e for e in ends if e >= t)
            history = torch.from_numpy(ids[max(0, end - context) : t])
            logits = model(input_ids=history[None, :]).logits[0, -1].double()
            nll -= torch.log_softmax(logits, dim=-1)[int(ids[t])].item()
            count += 1
    return nll, count


@pytest.mark.parametrize(("context", "stride"), [(16, 16), (16, 5), (16, 1), (10, 3)])
def test_perplexity_matches_token_by_token_brute_force(tiny_model, val_tokens, context, stride):
    max_tokens = 70  # not a multiple of any stride: a partial last pass
    result = perplexity(torch_logits_fn(tiny_model), val_tokens, context=context, stride=stride, max_tokens=max_tokens)
    nll, count = _brute_force(
        tiny_model, np.asarray(val_tokens[:max_tokens], dtype=np.int64), context=context, stride=stride
    )
    assert result.tokens == count == max_tokens - 1  # every token but the first, exactly once
    assert result.nll_sum == pytest.approx(nll, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert result.bits_per_token == pytest.approx(nll / count / math.log(2), rel=1e-5)
    assert (result.context, result.stride) == (context, stride)


def test_prefix_token_makes_the_first_token_scored(tiny_model, val_tokens):
    eos = 0
    ids = np.concatenate([[eos], np.asarray(val_tokens[:40], dtype=np.int64)])
    result = perplexity(torch_logits_fn(tiny_model), val_tokens, context=16, max_tokens=40, prefix=eos)
    nll, count = _brute_force(tiny_model, ids, context=16, stride=16)
    assert result.tokens == count == 40
    assert result.nll_sum == pytest.approx(nll, rel=1e-5)


def _lm_eval_rolling_windows(token_list, prefix_token, max_seq_len, context_len):
    """lm-evaluation-harness ``get_rolling_token_windows`` + ``make_disjoint_window``, restated."""
    pred_len = max_seq_len - context_len + 1
    first = min(max_seq_len, len(token_list))
    out = [([prefix_token, *token_list[: first - 1]], token_list[:first])]
    predicted = first
    while predicted < len(token_list):
        n = min(len(token_list) - predicted, pred_len)
        end = predicted + n
        out.append((token_list[end - max_seq_len - 1 : end - 1], token_list[end - n : end]))
        predicted += n
    # make_disjoint_window: the context is the input minus the part that overlaps the continuation
    return [(a[: len(a) - (len(b) - 1)], b) for a, b in out]


@pytest.mark.parametrize(("context", "stride", "n"), [(8, 8, 50), (8, 8, 8), (8, 3, 50), (8, 1, 20), (8, 8, 5)])
def test_windows_are_lm_eval_rolling_windows(context, stride, n):
    tokens = list(range(100, 100 + n))
    ours = windows(np.array(tokens), context=context, stride=stride, prefix=7)
    theirs = _lm_eval_rolling_windows(tokens, 7, max_seq_len=context, context_len=context - stride + 1)
    assert len(ours) == len(theirs)
    for w, (ctx, cont) in zip(ours, theirs, strict=True):
        fed = (ctx + cont)[:-1]  # the model input of the disjoint pair
        assert w.ids.tolist() == fed
        assert w.targets.tolist() == cont
        assert w.ids.size - w.first == len(cont)


def test_smaller_stride_gives_more_history_and_lower_perplexity_on_repetitive_text():
    # A unigram model that has seen the window: p(token) grows with how often it occurred in the input.
    vocab = 4

    def counting_logits(ids):
        counts = np.zeros((*ids.shape, vocab))
        for t in range(ids.shape[1]):
            counts[:, t] = np.eye(vocab)[ids[:, : t + 1]].sum(axis=1)
        return np.log(counts + 0.1)

    tokens = np.tile([0, 1, 2, 3], 30)
    wide = perplexity(counting_logits, tokens, context=8, stride=8)
    narrow = perplexity(counting_logits, tokens, context=8, stride=2)
    assert wide.tokens == narrow.tokens == tokens.size - 1
    assert narrow.perplexity < wide.perplexity


def test_bits_per_byte_counts_utf8_bytes_of_the_scored_text(tiny_tokenizer_dir):
    from lmforge.model.build import load_tokenizer

    tok = load_tokenizer(tiny_tokenizer_dir)
    text = "Thou art — naïve, 你好 ROMEO! 🌹"
    ids = np.array(tok(text)["input_ids"] + [tok.eos_token_id])
    assert scored_bytes(tok, ids) == len(text.encode("utf-8"))  # EOS counts zero bytes
    # the count is exact per token even where a token splits a multi-byte character
    assert sum(scored_bytes(tok, [i]) for i in ids) == len(text.encode("utf-8"))
    assert scored_ids(ids, prefix=tok.eos_token_id).tolist() == ids.tolist()
    assert scored_ids(ids).tolist() == ids[1:].tolist()

    result = perplexity(
        lambda x: np.zeros((*x.shape, len(tok)), np.float32),
        ids,
        context=8,
        prefix=tok.eos_token_id,
        byte_count=scored_bytes(tok, ids),
    )
    assert result.bits_per_byte == pytest.approx(ids.size * math.log2(len(tok)) / len(text.encode()), rel=1e-12)
    assert result.to_dict()["bits_per_byte"] == result.bits_per_byte


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


def test_non_overlapping_windows_are_capped_and_score_every_token_once():
    tokens = np.arange(21, dtype=np.uint16)
    got = windows(tokens, context=5)
    assert [w.ids.tolist() for w in got] == [
        [0, 1, 2, 3, 4],
        [5, 6, 7, 8, 9],
        [10, 11, 12, 13, 14],
        [15, 16, 17, 18, 19],
    ]
    assert [w.targets.tolist() for w in got][-1] == [16, 17, 18, 19, 20]
    assert all(w.ids.dtype == np.int64 for w in got)
    capped = windows(tokens, context=5, max_tokens=12)
    assert [w.ids.tolist() for w in capped] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [6, 7, 8, 9, 10]]
    assert [w.targets.tolist() for w in capped] == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11]]  # last: full history
    assert [w.first for w in capped] == [0, 0, 4]


def test_bad_context_or_stride_and_too_few_tokens_are_refused():
    with pytest.raises(ValueError, match="context"):
        windows(np.arange(10), context=0)
    with pytest.raises(ValueError, match="stride"):
        windows(np.arange(10), context=4, stride=5)
    with pytest.raises(ValueError, match="stride"):
        windows(np.arange(10), context=4, stride=0)
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


def test_decode_timing_separates_prefill_and_per_token_steps():
    from lmforge.metrics.latency import measure_decode

    calls = []

    class Fake:
        def prefill(self, ids):
            calls.append("prefill")
            return np.zeros(ids.shape[0], np.int64), 0

        def decode(self, token, state):
            calls.append("decode")
            return token, state + 1

    # prefill takes 10 ms, each decode step 2 ms: clock readings in pairs (start, end)
    durations = iter([0.010, 0.002, 0.002, 0.002] * 5)
    readings = iter(t for d in durations for t in (0.0, d))
    speed = measure_decode(
        Fake(), np.zeros((8, 5), np.int64), new_tokens=4, runs=3, warmup=2, clock=lambda: next(readings)
    )
    assert calls == (["prefill"] + ["decode"] * 3) * 5
    assert speed.prefill_p50_ms == pytest.approx(10.0) and speed.prefill_p99_ms == pytest.approx(10.0)
    assert speed.decode_p50_ms == pytest.approx(2.0) and speed.decode_p99_ms == pytest.approx(2.0)
    assert speed.decode_tokens_per_s == pytest.approx(8 / 0.002)
    assert (speed.batch_size, speed.prompt_tokens, speed.new_tokens, speed.runs) == (8, 5, 4, 3)


def test_torch_decode_runtime_generates_what_generate_does(tiny_model):
    from lmforge.metrics.latency import TorchDecodeRuntime

    runtime = TorchDecodeRuntime(tiny_model)
    ids = np.array([[5, 6, 7, 8], [9, 10, 11, 12]], dtype=np.int64)
    token, state = runtime.prefill(ids)
    got = [token]
    for _ in range(3):
        token, state = runtime.decode(token, state)
        got.append(token)
    with torch.no_grad():
        ref = tiny_model.generate(torch.from_numpy(ids), max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert np.stack(got, axis=1).tolist() == ref[:, 4:].tolist()
