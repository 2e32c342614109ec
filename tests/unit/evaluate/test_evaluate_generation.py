"""Generation metrics on hand cases, and batched greedy generation with left padding."""

from __future__ import annotations

import pytest
import torch

from lmforge.data.qa import QAPair
from lmforge.evaluate.generation import (
    UnicodeRougeTokenizer,
    clean_answer,
    exact_match,
    generate_answers,
    group_by_prompt,
    normalize_answer,
    prompt_and_reference,
    score_predictions,
    token_f1,
)


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("The Cat sat on a mat.", "cat sat on mat"),
        ("  An   apple!!  ", "apple"),
        ("theory of everything", "theory of everything"),  # "the" only as a whole word
        ("Café — NAÏVE façade", "café — naïve façade"),  # lower-cased; non-ASCII punctuation kept, as SQuAD
        ("你好，世界", "你好，世界"),
        ("", ""),
        ("the a an .", ""),
    ],
)
def test_normalize_answer_as_squad(text, normalized):
    assert normalize_answer(text) == normalized


@pytest.mark.parametrize(
    ("prediction", "reference", "em", "f1"),
    [
        ("The cat.", "cat", 1.0, 1.0),
        ("a cat sat", "the cat sat down", 0.0, 2 * (2 / 2) * (2 / 3) / (2 / 2 + 2 / 3)),
        ("cat cat", "cat", 0.0, 2 * 0.5 * 1.0 / 1.5),  # repeated tokens count once per occurrence
        ("dog", "cat", 0.0, 0.0),
        ("", "cat", 0.0, 0.0),  # empty prediction
        ("the", "a", 1.0, 1.0),  # both normalize to nothing: SQuAD v2 rule
        ("", "the", 1.0, 1.0),
        ("Ünïcödé wörds", "ünïcödé WÖRDS", 1.0, 1.0),
        ("你好 世界", "你好 朋友", 0.0, 0.5),
    ],
)
def test_exact_match_and_token_f1_hand_cases(prediction, reference, em, f1):
    assert exact_match(prediction, reference) == em
    assert token_f1(prediction, reference) == pytest.approx(f1)


def test_scores_take_the_best_reference_and_average_over_prompts():
    scores = score_predictions(
        ["the cat sat", "", "I like to count in binary."],
        [["a dog", "The cat sat."], ["anything"], ["I like to count in binary."]],
    )
    assert scores.prompts == 3
    assert scores.exact_match == pytest.approx(2 / 3)
    assert scores.f1 == pytest.approx(2 / 3)
    assert scores.rouge_l == pytest.approx(2 / 3)
    assert scores.empty_predictions == 1
    assert scores.bleu_signature.startswith("nrefs:var|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert 0.0 < scores.bleu < 100.0


def test_bleu_matches_sacrebleu_directly_and_is_100_for_identical_text():
    import sacrebleu

    hyps = ["the quick brown fox jumps over the lazy dog", "hello there my friend"]
    refs = ["the quick brown fox jumped over the lazy dog", "hello there my friend"]
    scores = score_predictions(hyps, [[r] for r in refs])
    assert scores.bleu == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    assert scores.bleu_signature.startswith("nrefs:1|")
    assert score_predictions(refs, [[r] for r in refs]).bleu == pytest.approx(100.0)


def test_all_empty_predictions_score_zero_without_error():
    scores = score_predictions(["", "  "], [["a cat"], ["the dog barks"]])
    assert (scores.exact_match, scores.f1, scores.bleu, scores.rouge_l) == (0.0, 0.0, 0.0, 0.0)
    assert scores.empty_predictions == 2


def test_rouge_l_uses_stemming_and_handles_unicode():
    stemmed = score_predictions(["the cats are running"], [["the cat runs"]])
    assert stemmed.rouge_l == pytest.approx(2 * 1.0 * 0.75 / 1.75)  # cat(s) and run(ning) match after stemming
    assert score_predictions(["你好世界"], [["你好世界"]]).rouge_l == pytest.approx(1.0)
    assert score_predictions(["你好朋友"], [["你好世界"]]).rouge_l == pytest.approx(0.5)
    assert score_predictions(["café naïve"], [["café naïve"]]).rouge_l == pytest.approx(1.0)


@pytest.mark.parametrize(
    "text",
    ["The cats are running, quickly!", "It's 3.14 -- e-mail me at foo_bar", "Running runners ran", ""],
)
def test_unicode_rouge_tokenizer_equals_rouge_scores_default_on_ascii(text):
    from rouge_score import tokenizers

    assert UnicodeRougeTokenizer().tokenize(text) == tokenizers.DefaultTokenizer(use_stemmer=True).tokenize(text)


def test_score_arguments_are_checked():
    with pytest.raises(ValueError, match="predictions for"):
        score_predictions(["a"], [["a"], ["b"]])
    with pytest.raises(ValueError, match="no predictions"):
        score_predictions([], [])
    with pytest.raises(ValueError, match="at least one reference"):
        score_predictions(["a"], [[]])


def test_group_by_prompt_keeps_every_answer_and_caps_prompts():
    pairs = [("q1", "a"), ("q2", "b"), ("q1", "c"), ("q3", "d"), ("q2", "e")]
    assert group_by_prompt(pairs) == [("q1", ["a", "c"]), ("q2", ["b", "e"]), ("q3", ["d"])]
    assert group_by_prompt(pairs, max_prompts=2) == [("q1", ["a", "c"]), ("q2", ["b", "e"])]


def test_prompts_are_templated_as_in_fine_tuning(tiny_lm):
    from lmforge.data.qa import Chat

    _, tok = tiny_lm
    assert prompt_and_reference(QAPair("Who are you?", "A bot."), tok) == ("Question: Who are you?\nAnswer:", "A bot.")
    chat = Chat((("user", "hi"), ("assistant", "hello"), ("user", "how are you?"), ("assistant", "fine")))
    prompt, reference = prompt_and_reference(chat, tok, "default")
    assert prompt == f"User: hi\nAssistant: hello{tok.eos_token}\nUser: how are you?\nAssistant:"
    assert reference == "fine"


def test_clean_answer_cuts_at_the_first_newline_when_asked():
    assert clean_answer(" Yes, I do.\nQuestion: more", stop_at_newline=True) == "Yes, I do."
    assert clean_answer(" a\nb ", stop_at_newline=False) == "a\nb"


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir):
    from lmforge.model.build import load_causal_lm, load_tokenizer

    return load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)


def test_batched_left_padded_generation_equals_one_prompt_at_a_time(tiny_lm):
    model, tok = tiny_lm
    prompts = [
        "Question: Who art thou?\nAnswer:",
        "Question: Hi\nAnswer:",
        "Question: What is the hour, good sir?\nAnswer:",
    ]
    kwargs = {"max_new_tokens": 6, "stop_at_newline": False, "seed": 0}
    batched = generate_answers(model, tok, prompts, batch_size=3, **kwargs)
    single = [generate_answers(model, tok, [p], batch_size=1, **kwargs)[0] for p in prompts]
    assert batched == single


def test_generation_is_greedy_with_the_kv_cache_and_restores_the_tokenizer(tiny_lm):
    model, tok = tiny_lm
    sides = (tok.padding_side, tok.truncation_side)
    prompt = "Question: Who art thou?\nAnswer:"
    got = generate_answers(model, tok, [prompt], max_new_tokens=5, batch_size=1, stop_at_newline=False)
    assert (tok.padding_side, tok.truncation_side) == sides

    # Reference: argmax token by token over the full sequence, no cache.
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        for _ in range(5):
            next_id = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
            if next_id.item() == tok.eos_token_id:
                break
    expected = tok.decode(ids[0, len(tok(prompt)["input_ids"]) :], skip_special_tokens=True)
    assert got == [expected.strip()]


def test_generation_refuses_more_new_tokens_than_positions(tiny_lm):
    model, tok = tiny_lm
    with pytest.raises(ValueError, match="leaves no room"):
        generate_answers(model, tok, ["x"], max_new_tokens=64, batch_size=1)


@pytest.mark.slow  # one ONNX export of the tiny model
def test_the_served_onnx_decoder_answers_as_the_pytorch_model_it_was_exported_from(tiny_model_dir, tmp_path):
    """evaluate scores the served model's own answers (its KV-cache decoder, left-padded batches)."""
    from lmforge.config import ExportConfig
    from lmforge.export.export_onnx import run as export_onnx
    from lmforge.model.base import base_tokenizer
    from lmforge.model.build import load_causal_lm
    from lmforge.onnx_runtime import OrtDecoderWithPast
    from tests.support.serve_helpers import redraw_weights

    model_dir = redraw_weights(tiny_model_dir, tmp_path / "model")  # varied continuations, clear argmax margins
    export_onnx(ExportConfig(), model=model_dir, onnx_model=tmp_path / "onnx")
    tokenizer = base_tokenizer(tmp_path / "onnx")
    prompts = ["Question: who art thou?\nAnswer:", "Q: hi\nA:", "Question: what light through yonder window?\nA:"]
    kwargs = {"max_new_tokens": 8, "batch_size": 3, "stop_at_newline": False}
    reference = generate_answers(load_causal_lm(model_dir), tokenizer, prompts, **kwargs)
    served = generate_answers(OrtDecoderWithPast(tmp_path / "onnx"), tokenizer, prompts, max_positions=64, **kwargs)
    assert served == reference
    assert len(set(reference)) > 1 and all(reference)  # distinct, non-empty answers: the comparison can fail
