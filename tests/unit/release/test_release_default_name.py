"""The default release name follows the corpus, is always a valid registry name, and keeps lmforge-demo for the demo."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmforge.naming import default_model_name
from lmforge.release.promote import VERSION_PATTERN

CASES = [
    ("demo://shakespeare", "lmforge-demo"),
    ("demo://chatterbot", "lmforge-demo"),
    ("/data/support/tickets.jsonl.gz", "tickets"),
    ("/data/support/tickets.jsonl.zst", "tickets"),
    ("corpus.parquet", "corpus"),
    ("notes.txt", "notes"),
    ("/data/wiki/", "wiki"),
    ("/data/wiki/*.parquet", "wiki"),
    ("data/2024-*/part-?.jsonl", "data"),
    ("s3://bucket/corpora/Support Tickets.jsonl.gz", "support-tickets"),
    ("s3://bucket/corpora/wiki-en/", "wiki-en"),
    ("s3://my-bucket", "my-bucket"),
    ("file:///srv/Données_2024.json", "donnees_2024"),
    ("/srv/__Legal  Docs__.jsonl", "legal-docs"),
    ("/srv/v1.2.txt", "v1.2"),
    ("/", "lmforge-model"),
    ("/srv/语料.txt", "lmforge-model"),
    ("*.jsonl", "lmforge-model"),
]


@pytest.mark.parametrize(("uri", "expected"), CASES)
def test_default_model_name_is_derived_from_the_corpus_name(uri, expected):
    assert default_model_name(uri) == expected


def test_a_long_corpus_name_is_cut_to_63_characters_without_a_trailing_separator():
    name = default_model_name("/data/" + "a" * 62 + "-b" * 10 + ".jsonl")
    assert len(name) <= 63 and name == "a" * 62


@given(st.text(max_size=120))
def test_every_derived_name_is_a_valid_release_name(uri):
    name = default_model_name(uri)
    assert VERSION_PATTERN.fullmatch(name) and name == name.lower()
    assert len(name) <= 63


@pytest.mark.parametrize(
    ("corpus", "given", "expected"),
    [("tickets.jsonl", "", "tickets"), ("demo://shakespeare", "", "lmforge-demo"), ("tickets.jsonl", "bot", "bot")],
)
def test_preflight_names_the_release_after_the_corpus_unless_a_name_is_given(tmp_path, corpus, given, expected):
    from lmforge.preflight import preflight

    if not corpus.startswith("demo://"):
        corpus = str(tmp_path / corpus)
        (tmp_path / "tickets.jsonl").write_text('{"text": "a ticket with enough words to be a document"}\n')
    result = preflight.run(
        corpus_uri=corpus,
        qa_uri="demo://chatterbot",
        release_root=str(tmp_path / "registry"),
        s3_secret_name="",
        model_name=given,
    )
    assert result.summary["model_name"] == expected
