"""Shared fixtures: small real artifacts built from packaged text, no network, no hub."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import pytest

from lmforge.data.demo import chatterbot_pairs, shakespeare_documents
from tests.support.demo_artifacts import write_random_model, write_shards, write_tokenizer
from tests.support.mlflow_fixtures import mlflow_executable, mlflow_server, tracking_env  # noqa: F401 - shared fixtures
from tests.support.tiny_training import TINY_MODEL


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """Put the root logger back after each test: a stage run in-process installs a handler on pytest's captured
    stderr (``setup_logging``), and a later test's log line to that closed stream prints "--- Logging error ---"."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def shakespeare_docs() -> list[dict[str, str]]:
    """The first 60 scenes of the packaged Shakespeare demo corpus."""
    return list(itertools.islice(shakespeare_documents(), 60))


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory, shakespeare_docs) -> Path:
    """A 512-token byte-level BPE trained on a few scenes, saved in HF format."""
    return write_tokenizer((d["text"] for d in shakespeare_docs), tmp_path_factory.mktemp("tokenizer"), vocab_size=512)


@pytest.fixture(scope="session")
def tiny_shards_dir(tmp_path_factory, tiny_tokenizer_dir, shakespeare_docs) -> Path:
    """Token shards of the tiny corpus: every 10th scene goes to ``val``."""
    out = tmp_path_factory.mktemp("shards")
    write_shards((d["text"] for d in shakespeare_docs), tiny_tokenizer_dir, out, shard_tokens=20_000)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A randomly initialized 2-layer GPT-2 with the tiny tokenizer, in HF layout."""
    return write_random_model(TINY_MODEL, tiny_tokenizer_dir, tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def qa_jsonl(tmp_path_factory) -> Path:
    """The packaged chatterbot Q&A pairs as a JSONL file."""
    path = tmp_path_factory.mktemp("qa") / "qa.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for pair in chatterbot_pairs():
            fh.write(json.dumps(pair) + "\n")
    return path


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real SeaweedFS S3 server on loopback for the whole session."""
    from tests.support.s3server import SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """Point lmforge.storage (boto3) at the test server; yields a fresh bucket name."""
    import uuid

    from lmforge import storage

    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    storage.s3_client.cache_clear()
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    storage.s3_client().create_bucket(Bucket=bucket)
    yield bucket
    storage.s3_client.cache_clear()
