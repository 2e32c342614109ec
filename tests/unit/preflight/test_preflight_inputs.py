"""Preflight reads a sample of each input with the stages' readers and names each mistake in one line, with a hint."""

from __future__ import annotations

import gzip
import json
import socket

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge import storage
from lmforge.config import CleanConfig
from lmforge.data.corpus import CorpusReader, first_file_uri
from lmforge.errors import FieldMissingError, InputDataError, StorageError
from lmforge.preflight.preflight import PreflightError, run_checks

SCENE = "a scene with enough words in it to be a document"


def _jsonl(path, records, *, gz=False):
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def _qa(tmp_path, records=({"prompt": "hi", "response": "hello"},)):
    return _jsonl(tmp_path / "qa.jsonl", records)


def _failure(tmp_path, *, corpus, qa=None, clean=None, release_root=None) -> str:
    with pytest.raises(PreflightError) as info:
        run_checks(
            corpus_uri=str(corpus),
            qa_uri=str(qa or _qa(tmp_path)),
            release_root=release_root or str(tmp_path / "registry"),
            s3_secret_name="",
            clean=clean,
        )
    message = str(info.value)
    assert "\n" not in message
    return message


def test_corpus_without_the_text_field_names_clean_text_field_the_fields_there_and_the_likely_one(tmp_path):
    corpus = _jsonl(tmp_path / "docs.jsonl.gz", [{"id": 1, "lang": "en", "content": SCENE}], gz=True)
    message = _failure(tmp_path, corpus=corpus)
    assert "corpus_sample:" in message and "docs.jsonl.gz:1: field 'text' missing" in message
    assert "the record has: 'id', 'lang', 'content'" in message
    assert "did you mean clean.text_field='content'?" in message


def test_a_typo_in_clean_text_field_suggests_the_nearest_field_name(tmp_path):
    corpus = _jsonl(tmp_path / "docs.jsonl", [{"text": SCENE, "title": "a much longer title string than the text"}])
    message = _failure(tmp_path, corpus=corpus, clean=CleanConfig(text_field="txet"))
    assert "clean.text_field is 'txet': did you mean clean.text_field='text'?" in message


def test_parquet_corpus_without_the_text_column_names_its_string_columns(tmp_path):
    corpus = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"n": [1], "body": [SCENE]}), corpus)
    message = _failure(tmp_path, corpus=corpus)
    assert "no column 'text' (columns: 'n', 'body')" in message
    assert "did you mean clean.text_field='body'?" in message


@pytest.mark.parametrize("content", [b"", b"\n\n"], ids=["empty-file", "blank-lines"])
def test_an_empty_corpus_fails_in_preflight(tmp_path, content):
    corpus = tmp_path / "empty.jsonl"
    corpus.write_bytes(content)
    assert f"corpus_sample: {corpus}: no documents" in _failure(tmp_path, corpus=corpus)


def test_a_corpus_of_blank_documents_fails_in_preflight(tmp_path):
    corpus = _jsonl(tmp_path / "blank.jsonl", [{"text": "  "}, {"text": "\n"}])
    assert "all 2 documents are blank" in _failure(tmp_path, corpus=corpus)


def test_bad_records_within_clean_max_bad_records_pass_as_they_do_in_the_stage(tmp_path):
    corpus = _jsonl(tmp_path / "docs.jsonl", [{"body": "x"}, {"text": SCENE}])
    assert "max_bad_records=0" in _failure(tmp_path, corpus=corpus)
    report = run_checks(
        corpus_uri=str(corpus),
        qa_uri=str(_qa(tmp_path)),
        release_root=str(tmp_path / "registry"),
        s3_secret_name="",
        clean=CleanConfig(max_bad_records=1),
    )
    assert report.checks["corpus_sample"] == "ok"


def test_qa_with_question_answer_fields_names_the_expected_fields(tmp_path):
    corpus = _jsonl(tmp_path / "docs.jsonl", [{"text": SCENE}])
    qa = _qa(tmp_path, [{"question": "hi?", "answer": "hello"}])
    message = _failure(tmp_path, corpus=corpus, qa=qa)
    assert f"qa_sample: {qa}:1: no 'prompt'/'response' field; the record has 'question', 'answer'" in message
    assert "rename question → prompt, answer → response" in message and '"messages"' in message


def test_an_empty_qa_file_fails_in_preflight(tmp_path):
    corpus = _jsonl(tmp_path / "docs.jsonl", [{"text": SCENE}])
    qa = tmp_path / "qa.jsonl"
    qa.write_text("")
    assert "qa_sample: Q&A data" in _failure(tmp_path, corpus=corpus, qa=qa)


def test_chat_qa_and_a_text_corpus_pass(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(SCENE)
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    report = run_checks(
        corpus_uri=str(tmp_path / "corpus"),
        qa_uri=str(_qa(tmp_path, [chat])),
        release_root=str(tmp_path / "registry"),
        s3_secret_name="",
    )
    assert report.checks["corpus_sample"] == report.checks["qa_sample"] == "ok"


def test_the_demo_inputs_pass_preflight(tmp_path):
    report = run_checks(
        corpus_uri="demo://shakespeare",
        qa_uri="demo://chatterbot",
        release_root=str(tmp_path / "registry"),
        s3_secret_name="",
        model_name="lmforge-demo",
    )
    assert not report.failed and set(report.fingerprints) == {"corpus", "qa", "production"}


def test_the_corpus_reader_error_itself_lists_the_fields_the_records_have(tmp_path):
    corpus = _jsonl(tmp_path / "docs.jsonl", [{"body\nx": SCENE}])
    with pytest.raises(FieldMissingError) as info:
        list(CorpusReader(corpus))
    assert "field 'text' missing (the record has: 'body\\nx')" in str(info.value)
    assert info.value.text_fields == ("body\nx",)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def s3_settings(monkeypatch):
    """Set S3 environment variables for one test, with a fresh boto3 session and storage client before and after."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # the default session keeps the credentials it found
    storage.s3_client.cache_clear()
    yield monkeypatch
    storage.s3_client.cache_clear()


def test_s3_without_an_endpoint_fails_at_once_with_a_hint_about_aws_endpoint_url(tmp_path, s3_settings):
    s3_settings.setenv("AWS_ACCESS_KEY_ID", "key")
    s3_settings.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    s3_settings.setenv("AWS_DEFAULT_REGION", "xx-nowhere-1")  # an AWS host name that resolves nowhere
    message = _failure(tmp_path, corpus="s3://corpora/docs.jsonl")
    assert "s3_endpoint: cannot connect to the S3 endpoint https://s3.xx-nowhere-1.amazonaws.com" in message
    assert message.endswith(
        "hint: no S3 endpoint is configured, so https://s3.xx-nowhere-1.amazonaws.com (AWS S3) was used; for MinIO, "
        "SeaweedFS or another S3 server set AWS_ENDPOINT_URL (e.g. http://minio.kubeflow:9000)"
    )
    assert "corpus_readable" not in message  # not attempted: it would wait for botocore's retries


def test_an_unreachable_configured_endpoint_fails_without_checking_the_s3_inputs(tmp_path, s3_settings):
    s3_settings.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")
    corpus = _jsonl(tmp_path / "docs.jsonl", [{"text": SCENE}])
    message = _failure(tmp_path, corpus=corpus, release_root="s3://registry/models")
    assert "s3_endpoint: cannot connect to the S3 endpoint http://127.0.0.1:" in message
    assert "release_root" not in message and "hint" not in message


def test_an_endpoint_that_is_not_a_url_is_a_one_line_error(tmp_path, s3_settings):
    s3_settings.setenv("AWS_ENDPOINT_URL", "minio:9000")
    message = _failure(tmp_path, corpus="s3://corpora/docs.jsonl")
    assert "s3_endpoint:" in message and "AWS_ENDPOINT_URL must be a URL such as http://minio:9000" in message


def test_s3_without_credentials_is_a_storage_error_not_a_botocore_traceback(s3_settings):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        s3_settings.delenv(name, raising=False)
    s3_settings.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")  # never reached: no credentials
    with pytest.raises(StorageError, match="head s3://corpora/docs.jsonl: Unable to locate credentials"):
        storage.is_file("s3://corpora/docs.jsonl")


@pytest.mark.s3
def test_an_s3_corpus_prefix_is_sampled_from_its_first_file(tmp_path, s3_env):
    base = f"s3://{s3_env}/raw"
    storage.write_bytes(f"{base}/.hidden/x.jsonl", b'{"text": "hidden"}\n')
    storage.write_bytes(f"{base}/README.md", b"not a corpus file")
    storage.write_bytes(f"{base}/part-0.jsonl", b'{"content": "' + SCENE.encode() + b'"}\n')
    storage.write_bytes(f"{base}/part-1.jsonl", b'{"text": "fine"}\n')
    assert first_file_uri(base) == f"{base}/part-0.jsonl"
    assert first_file_uri(f"{base}/part-1.jsonl") == f"{base}/part-1.jsonl"
    message = _failure(tmp_path, corpus=base)
    assert f"{base}/part-0.jsonl:1: field 'text' missing" in message and "clean.text_field='content'" in message
    assert "hint" not in message


def test_preflight_error_is_an_input_error():
    assert issubclass(PreflightError, InputDataError)


def test_a_bad_stage_override_fails_in_preflight_naming_the_field_and_the_nearest_one(tmp_path):
    corpus = _jsonl(tmp_path / "docs.jsonl", [{"text": SCENE}])
    with pytest.raises(PreflightError) as info:
        run_checks(
            corpus_uri=str(corpus),
            qa_uri=str(_qa(tmp_path)),
            release_root=str(tmp_path / "registry"),
            s3_secret_name="",
            preset="tiny-cpu",
            stage_overrides={"pretrain": '{"train.max_stepz": 1}', "distill": {"temperature": -1.0}, "pretrian": {}},
        )
    message = str(info.value)
    assert "stage_configs: unknown config section 'pretrian' (did you mean 'pretrain'?)" in message
    assert "pretrain.train.max_stepz: Extra inputs are not permitted (got 1) (did you mean 'max_steps'?)" in message
    assert "distill.temperature: Input should be greater than 0" in message


def test_the_clean_overrides_set_the_corpus_reader_of_the_sample(tmp_path):
    corpus = _jsonl(tmp_path / "docs.jsonl", [{"body": SCENE}])
    report = run_checks(
        corpus_uri=str(corpus),
        qa_uri=str(_qa(tmp_path)),
        release_root=str(tmp_path / "registry"),
        s3_secret_name="",
        preset="tiny-cpu",
        stage_overrides={"clean": {"text_field": "body"}, "pretrain": {"train.max_steps": 1}},
    )
    assert report.checks["stage_configs"] == report.checks["corpus_sample"] == "ok"
