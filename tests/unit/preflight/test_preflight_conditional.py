"""Preflight probes that the object store enforces conditional writes."""

from __future__ import annotations

import pytest

from lmforge import storage
from lmforge.preflight.preflight import PreflightError, check_conditional_writes, run_checks


def _server_ignoring(*headers: str):
    """Stand-in for an S3 server that ignores ``headers``: a botocore hook drops them from every PutObject
    before it is signed and sent, so the real SeaweedFS underneath never sees them. To lmforge this is
    indistinguishable from a server that accepts the header and ignores it, which is what is being probed."""

    def strip(request, **kwargs):
        for header in headers:
            if header in request.headers:
                del request.headers[header]

    storage.s3_client().meta.events.register("before-sign.s3.PutObject", strip)


def test_a_local_release_root_passes_and_keeps_no_probe(tmp_path):
    assert check_conditional_writes(str(tmp_path / "registry")) == "ok"
    assert not [p for p in (tmp_path / "registry").rglob("*") if p.is_file()]


@pytest.mark.s3
def test_the_real_s3_server_enforces_if_none_match_and_if_match(s3_env):
    root = f"s3://{s3_env}/registry"
    assert check_conditional_writes(root) == "ok"
    assert storage.list_files(root) == []  # the probe is deleted


@pytest.mark.s3
def test_a_server_ignoring_if_none_match_fails_preflight_with_the_reason(s3_env, tmp_path):
    _server_ignoring("If-None-Match", "If-Match")
    root = f"s3://{s3_env}/registry"
    assert "ignores If-None-Match" in check_conditional_writes(root)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "x"}\n')
    with pytest.raises(PreflightError, match=r"release_root_conditional_writes: .*ignores If-None-Match"):
        run_checks(corpus_uri=str(corpus), qa_uri="demo://chatterbot", release_root=root, s3_secret_name="")
    assert storage.list_files(root) == []


@pytest.mark.s3
def test_a_server_ignoring_only_if_match_is_caught_too(s3_env):
    _server_ignoring("If-Match")
    assert "ignores If-Match" in check_conditional_writes(f"s3://{s3_env}/registry")
