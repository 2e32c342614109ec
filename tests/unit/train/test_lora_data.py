"""Fine-tuning data: prompt/response and chat rendering, answer-only labels, packing, bad JSONL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.data.qa import (
    Chat,
    QAPair,
    Segment,
    default_chat_segments,
    encode_example,
    load_examples,
    render_segments,
    split_examples,
)
from lmforge.errors import InputDataError
from lmforge.model.build import load_tokenizer
from lmforge.train import finetune_lora
from lmforge.train.batches import collate

# ChatML, the template of many instruction-tuned models (Qwen, ...).
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = Chat((("system", "Be brief."), ("user", "Who is Romeo?"), ("assistant", "A lover."), ("user", "And?")))
TWO_ANSWERS = Chat((("user", "Hi"), ("assistant", "Hello."), ("user", "Bye"), ("assistant", "Farewell.")))


@pytest.fixture
def tok(tiny_tokenizer_dir):
    return load_tokenizer(tiny_tokenizer_dir)


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_prompt_and_padding_positions_are_masked_from_the_loss(tok):
    pair = QAPair("Who is Romeo?", "A lover.")
    prompt_ids = tok("Question: Who is Romeo?\nAnswer:")["input_ids"]
    response_ids = tok(" A lover.<|endoftext|>")["input_ids"]
    assert response_ids[-1] == tok.eos_token_id

    ids, labels = encode_example(tok, pair, max_len=100)
    assert ids == prompt_ids + response_ids
    assert labels == [-100] * len(prompt_ids) + response_ids

    short_ids, short_labels = encode_example(tok, pair, max_len=len(prompt_ids) + 1)
    assert short_ids == prompt_ids + response_ids[:1] and short_labels[-1] == response_ids[0]

    batch = collate([(ids, labels), (ids[:3], labels[:3])], pad_id=tok.pad_token_id)
    assert batch["input_ids"].shape == (2, len(ids) - 1)
    assert batch["input_ids"][0].tolist() == ids[:-1] and batch["targets"][0].tolist() == labels[1:]
    assert batch["input_ids"][1, 3:].eq(tok.pad_token_id).all()
    assert batch["targets"][1].eq(-100).all()  # three prompt tokens then padding: nothing scored


def test_default_chat_template_scores_assistant_answers_only(tok):
    eos = tok.eos_token
    assert default_chat_segments(TWO_ANSWERS, eos) == [
        Segment("User: Hi\n", False),
        Segment("Assistant:", False),
        Segment(f" Hello.{eos}", True),
        Segment("\n", False),
        Segment("User: Bye\n", False),
        Segment("Assistant:", False),
        Segment(f" Farewell.{eos}", True),
    ]
    assert tok.chat_template is None  # the tiny BPE has no template, so auto falls back to the default
    assert render_segments(TWO_ANSWERS, tok, "auto") == default_chat_segments(TWO_ANSWERS, eos)
    ids, labels = encode_example(tok, TWO_ANSWERS, max_len=1000)
    scored = [t for t in labels if t != -100]
    assert scored == tok(f" Hello.{eos}")["input_ids"] + tok(f" Farewell.{eos}")["input_ids"]
    assert len(ids) == len(labels)


def test_chat_template_of_the_tokenizer_is_used_and_end_of_turn_is_scored(tok):
    tok.chat_template = CHATML
    segments = render_segments(CHAT, tok, "auto")
    assert segments == [
        Segment("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho is Romeo?<|im_end|>\n"
                "<|im_start|>assistant\n", False),
        Segment("A lover.<|im_end|>\n", True),
        Segment("<|im_start|>user\nAnd?<|im_end|>\n", False),
    ]  # fmt: skip
    assert "".join(s.text for s in segments) == tok.apply_chat_template(CHAT.as_dicts(), tokenize=False)
    _, labels = encode_example(tok, CHAT, max_len=1000)
    assert [t for t in labels if t != -100] == tok("A lover.<|im_end|>\n", add_special_tokens=False)["input_ids"]
    # chat_template=default ignores the tokenizer's template
    assert render_segments(CHAT, tok, "default") == default_chat_segments(CHAT, tok.eos_token)


def test_chat_template_that_rewrites_earlier_turns_is_refused(tok):
    tok.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(InputDataError, match="does not render message 1 as an extension") as info:
        render_segments(Chat((("user", "a"), ("assistant", "b"))), tok, "auto")
    assert "\n" not in str(info.value)


def test_packing_fills_rows_with_whole_stream_and_keeps_labels_aligned():
    examples = [([1, 2, 3], [-100, 2, 3]), ([4, 5], [-100, 5]), ([6, 7, 8, 9], [-100, -100, 8, 9])]
    rows = finetune_lora.pack(examples, width=4, seed=0)
    assert len(rows) == 2 and all(len(ids) == len(labels) == 4 for ids, labels in rows)
    stream = [t for ids, _ in rows for t in ids]
    label_of = {ids: labels for ex in examples for ids, labels in zip(*ex, strict=True)}
    assert all(label_of[t] == lab for ids, labels in rows for t, lab in zip(ids, labels, strict=True))
    assert len(set(stream)) == 8  # 9 tokens in all, the one-token tail is dropped
    with pytest.raises(Exception, match="fewer than one row of 40 tokens"):
        finetune_lora.pack(examples, width=40, seed=0)


def test_jsonl_with_messages_and_pairs_loads_and_splits_by_prompt(tmp_path):
    path = _write(
        tmp_path / "mixed.jsonl",
        [
            json.dumps({"prompt": "Q1", "response": "A1"}),
            json.dumps({"prompt": "Q1", "response": "A1 again"}),
            "",
            json.dumps({"messages": [{"role": "user", "content": " Hi "}, {"role": "assistant", "content": "Yo"}]}),
        ],
    )
    examples = load_examples(str(path))
    assert examples == [QAPair("Q1", "A1"), QAPair("Q1", "A1 again"), Chat((("user", "Hi"), ("assistant", "Yo")))]
    train, heldout = split_examples(examples * 20 + [QAPair(f"q{i}", "a") for i in range(40)], 0.3)
    held_prompts = {e.key for e in heldout}
    assert not held_prompts & {e.key for e in train}  # answers to one question stay on one side


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([], r"qa\.jsonl: no examples \(the file is empty\)"),
        (["", "  "], r"no examples"),
        (['{"prompt": "a", "response": "b"}', "{not json"], r"qa\.jsonl:2: not valid JSON"),
        (["[1, 2]"], r"qa\.jsonl:1: expected a JSON object"),
        (['{"prompt": "a"}'], r"qa\.jsonl:1: no 'response' field; the record has 'prompt'; each line needs"),
        (['{"prompt": "a", "response": "  "}'], r"field 'response' is not a non-empty string"),
        (['{"question": "a", "answer": "b"}'], r"no 'prompt'/'response' field.*rename question → prompt, answer"),
        (['{"messages": []}'], r"qa\.jsonl:1: 'messages' must be a non-empty list"),
        (['{"messages": [{"role": "bot", "content": "x"}]}'], r"messages\[0\]\.role must be one of"),
        (['{"messages": [{"role": "user"}]}'], r"messages\[0\]\.content missing"),
        (['{"messages": [{"role": "user", "content": "x"}]}'], r"no non-empty assistant message"),
    ],
)
def test_empty_or_malformed_jsonl_is_a_one_line_error_naming_file_and_line(tmp_path, lines, message):
    path = _write(tmp_path / "qa.jsonl", lines) if lines else tmp_path / "qa.jsonl"
    if not lines:
        path.write_text("")
    with pytest.raises(InputDataError, match=message) as info:
        load_examples(str(path))
    assert "\n" not in str(info.value)
