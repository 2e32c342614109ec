"""A local corpus folder or glob is read without leaving it: every symbolic link below it is refused, by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.data.corpus import CorpusReader
from lmforge.errors import UnsafePathError
from lmforge.preflight.preflight import PreflightError, fingerprint_uri, run_checks

SECRET = "root:x:0:0:the secret outside the corpus folder"


@pytest.fixture
def outside(tmp_path) -> Path:
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "secret.jsonl").write_text(json.dumps({"text": SECRET}) + "\n")
    (folder / "passwd.txt").write_text(SECRET)
    return folder


def _corpus(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text(json.dumps({"text": "a document inside the folder"}) + "\n")
    return corpus


@pytest.mark.parametrize(("link", "target"), [("link.jsonl", "secret.jsonl"), ("passwd.txt", "passwd.txt")])
def test_a_linked_file_in_a_corpus_folder_is_refused_naming_it_before_any_document(tmp_path, outside, link, target):
    corpus = _corpus(tmp_path)
    (corpus / link).symlink_to(outside / target)
    reader = CorpusReader(corpus)
    with pytest.raises(UnsafePathError, match=rf"{link} is a symbolic link \(to {outside / target}\)"):
        next(iter(reader))
    assert reader.files == []


def test_a_linked_folder_or_a_link_matched_by_a_glob_is_refused(tmp_path, outside):
    corpus = _corpus(tmp_path)
    (corpus / "sub").symlink_to(outside)
    with pytest.raises(UnsafePathError, match=r"sub is a symbolic link"):
        list(CorpusReader(corpus))
    with pytest.raises(UnsafePathError, match=rf"{corpus / 'sub'} is a symbolic link \(to {outside}\)"):
        list(CorpusReader(f"{corpus}/**/*.jsonl"))
    (corpus / "sub").unlink()
    (corpus / "link.jsonl").symlink_to(outside / "secret.jsonl")
    with pytest.raises(UnsafePathError, match=rf"{corpus / 'link.jsonl'} is a symbolic link"):
        list(CorpusReader(f"{corpus}/*.jsonl"))


def test_preflight_names_the_link_and_never_fingerprints_what_it_points_to(tmp_path, outside):
    corpus = _corpus(tmp_path)
    (corpus / "passwd.txt").symlink_to(outside / "passwd.txt")
    with pytest.raises(PreflightError, match=r"corpus_\w+: .*passwd\.txt is a symbolic link"):
        run_checks(
            corpus_uri=str(corpus), qa_uri="demo://chatterbot", release_root=str(tmp_path / "reg"), s3_secret_name=""
        )
    with pytest.raises(UnsafePathError, match=r"passwd\.txt is a symbolic link"):
        fingerprint_uri(str(corpus))
