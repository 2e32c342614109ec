"""Sentence-aware chunking (spaCy sentencizer, no download) and the split of long fine-tuning examples."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmforge.data.chunking import SentenceChunker, resolve_lang
from lmforge.data.qa import (
    IGNORE_INDEX,
    Chat,
    QAPair,
    encode_example,
    encode_examples,
    split_long_example,
    with_final_answer,
)
from lmforge.errors import ConfigError
from lmforge.model.build import load_tokenizer
from lmforge.stages import resolve_config

EN_SENTENCES = [
    "The ship left the harbour before dawn.",
    "Nobody on the quay waved goodbye!",
    "Was the captain sure of the weather?",
    "Mr. Hale said the wind would turn by noon.",
    "It did not.",
    "By evening the sails were torn, the deck was awash and the crew had stopped singing.",
    "They reached the island three days later.",
]
ZH_SENTENCES = ["今天天气很好。", "我们去公园散步吧！", "你想一起去吗？", "他说：“好的。”", "于是我们出发了。"]
ZH_ENDS = ("。", "！", "？", "”")


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    return load_tokenizer(tiny_tokenizer_dir)


def squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def count(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_english_chunks_pack_whole_sentences_within_chunk_size(tok):
    text = "  ".join(EN_SENTENCES[:3]) + "\n\n" + " ".join(EN_SENTENCES[3:])
    chunk_size = max(count(tok, s) for s in EN_SENTENCES) + 4
    chunks = SentenceChunker(tok, chunk_size, "en").chunk(text)

    assert all(c.tokens == count(tok, c.text) <= chunk_size and not c.forced for c in chunks)
    # every chunk is a run of whole sentences, in order, and together they are the text
    assert [s for c in chunks for s in EN_SENTENCES if s in c.text] == EN_SENTENCES
    assert all(c.text.endswith((".", "!", "?")) for c in chunks)
    assert squash("".join(c.text for c in chunks)) == squash(text)
    assert len(chunks) < len(EN_SENTENCES)  # short sentences share a chunk


def test_chinese_chunks_end_at_chinese_sentence_punctuation(tok):
    text = "".join(ZH_SENTENCES)
    chunk_size = max(count(tok, s) for s in ZH_SENTENCES) + 2
    chunks = SentenceChunker(tok, chunk_size, "zh").chunk(text)

    assert all(c.tokens == count(tok, c.text) <= chunk_size and not c.forced for c in chunks)
    assert all(c.text.endswith(ZH_ENDS) for c in chunks)
    assert "".join(c.text for c in chunks) == text
    assert any(c.text == "他说：“好的。”" for c in chunks)  # the closing quote stays with its sentence
    # auto without a detected language reads the script: mostly Han, so the zh rules
    assert SentenceChunker(tok, chunk_size, "auto").chunk(text) == chunks
    # the en rules do not split a run of Han characters at 。, so only forced cuts fit it
    assert any(c.forced for c in SentenceChunker(tok, chunk_size, "en").chunk(text))


@pytest.mark.parametrize(
    ("setting", "record_lang", "text", "expected"),
    [
        ("en", "zh", "中文。", "en"),
        ("zh", None, "English.", "zh"),
        ("auto", "zh", "Mostly English.", "zh"),
        ("auto", "fr", "中文。", "en"),
        ("auto", "und", "中文的句子。Some.", "zh"),
        ("auto", None, "Some words and one 字.", "en"),
    ],
)
def test_auto_language_is_the_records_detected_language_else_the_script(setting, record_lang, text, expected):
    assert resolve_lang(setting, record_lang, text) == expected


@pytest.mark.parametrize(
    ("sentence", "lang"),
    [("and then the moon " * 30 + "rose.", "en"), ("我们在公园里慢慢地散步" * 6 + "。", "zh")],
    ids=["en", "zh"],
)
def test_a_sentence_longer_than_chunk_size_is_cut_without_loss(tok, sentence, lang):
    text = f"Short one. {sentence} 短句。"
    chunks = SentenceChunker(tok, 16, lang).chunk(text)

    assert all(c.tokens == count(tok, c.text) <= 16 for c in chunks)
    assert squash("".join(c.text for c in chunks)) == squash(text)
    long_parts = [c for c in chunks if squash(c.text) in squash(sentence)]
    assert len(long_parts) > 2
    assert [c.forced for c in long_parts] == [True] * (len(long_parts) - 1) + [False]
    assert "\ufffd" not in "".join(c.text for c in chunks)  # cuts never fall inside a character
    if lang == "en":  # a cut between words is preferred to one inside a word
        assert all(c.text.split()[-1] in {"and", "then", "the", "moon", "rose."} for c in chunks[1:-2])


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet="ab cd.!?\n。！？天气很好Zé", max_size=300),
    chunk_size=st.integers(8, 40),
    lang=st.sampled_from(["en", "zh"]),
)
def test_chunks_never_exceed_chunk_size_and_lose_nothing(tok, text, chunk_size, lang):
    chunks = SentenceChunker(tok, chunk_size, lang).chunk(text)
    assert all(c.text and c.text == c.text.strip() for c in chunks)
    assert all(c.tokens == count(tok, c.text) <= chunk_size for c in chunks)
    assert squash("".join(c.text for c in chunks)) == squash(text)


def test_chunk_many_keeps_each_texts_chunks_apart(tok):
    texts = ["One. Two.", "", "Three.", "四。五。"]
    many = SentenceChunker(tok, 32, "auto").chunk_many(texts, [None, None, "en", None])
    assert [[c.text for c in chunks] for chunks in many] == [["One. Two."], [], ["Three."], ["四。五。"]]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"finetune_lora.split_lang": "de"}, "finetune_lora.split_lang"),
        ({"finetune_lora.split_lang": 1}, "finetune_lora.split_lang"),
    ],
)
def test_invalid_chunking_settings_are_rejected_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        resolve_config("tiny-cpu", overrides)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_chunker_refuses_a_chunk_size_too_small_for_one_character(tok):
    with pytest.raises(ValueError, match="chunk_size must be at least 8"):
        SentenceChunker(tok, 7)


def _scored_text(tok, labels: list[int]) -> str:
    return tok.decode([t for t in labels if t != IGNORE_INDEX])


def test_long_answer_is_split_along_sentences_and_each_part_keeps_the_prompt(tok):
    pair = QAPair("Tell me about the voyage.", " ".join(EN_SENTENCES))
    prompt_ids = tok(pair.prompt_text())["input_ids"]
    max_len = len(prompt_ids) + 48  # room for the longest sentence, not for two long ones

    rows = split_long_example(tok, pair, max_len, lang="auto")
    assert len(rows) > 1
    for ids, labels in rows:
        assert len(ids) == len(labels) <= max_len
        assert ids[: len(prompt_ids)] == prompt_ids and labels[: len(prompt_ids)] == [IGNORE_INDEX] * len(prompt_ids)
        assert ids[-1] == labels[-1] == tok.eos_token_id
    answers = [_scored_text(tok, labels).removesuffix(tok.eos_token).strip() for _, labels in rows]
    assert all(a.endswith((".", "!", "?")) for a in answers)  # each part ends at a sentence end
    assert " ".join(answers) == pair.response

    # the switch off (split_lang None) truncates as before; a short example is never split
    short = QAPair("Hi?", "Hello.")
    off, split_off = encode_examples(tok, [pair, short], max_len)
    assert split_off == 0 and off == [encode_example(tok, e, max_len) for e in (pair, short)]
    on, split_on = encode_examples(tok, [pair, short], max_len, split_lang="en")
    assert split_on == 1 and on == [*rows, encode_example(tok, short, max_len)]


def test_long_final_chat_answer_is_split_and_earlier_turns_repeat(tok):
    chat = Chat(
        (("user", "Hi"), ("assistant", "Hello."), ("user", "Tell me a story."), ("assistant", "".join(ZH_SENTENCES)))
    )
    head = encode_example(tok, with_final_answer(chat, ""), 1000)[0][:-2]  # up to "Assistant:"
    rows = split_long_example(tok, chat, len(head) + 30, lang="zh")
    assert len(rows) > 1
    assert all(ids[: len(head)] == head and len(ids) <= len(head) + 30 for ids, _ in rows)
    last_answers = [_scored_text(tok, labels).split(tok.eos_token)[-2] for _, labels in rows]
    assert "".join(a.strip() for a in last_answers) == "".join(ZH_SENTENCES)


def test_example_whose_prompt_leaves_no_room_for_an_answer_is_truncated(tok):
    pair = QAPair("word " * 40, "An answer. " * 10)
    assert split_long_example(tok, pair, 30, lang="en") == [encode_example(tok, pair, 30)]
