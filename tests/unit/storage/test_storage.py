"""lmforge.storage and lmforge.artifacts against local disk and a real S3 server on loopback."""

from __future__ import annotations

import json

import pytest

from lmforge import storage
from lmforge.artifacts import read_manifest, staged_output, write_manifest
from lmforge.errors import ArtifactIncompleteError, InputDataError, StorageError


def test_local_write_bytes_is_atomic_and_leaves_no_temp_files(tmp_path):
    target = tmp_path / "a" / "b.txt"
    storage.write_bytes(str(target), b"hello")
    storage.write_bytes(str(target), b"world")
    assert target.read_bytes() == b"world"
    assert [p.name for p in target.parent.iterdir()] == ["b.txt"]


def test_staged_output_failure_leaves_nothing(tmp_path):
    final = tmp_path / "out"
    with pytest.raises(RuntimeError), staged_output(final) as scratch:
        (scratch / "half.bin").write_bytes(b"x")
        raise RuntimeError("boom")
    assert not final.exists()
    assert list(tmp_path.iterdir()) == []


def test_staged_output_refuses_non_empty_target(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "keep.txt").write_text("precious")
    with pytest.raises(InputDataError, match="already exists"), staged_output(final):
        pass
    assert (final / "keep.txt").read_text() == "precious"


def test_manifest_detects_missing_and_flipped_bytes(tmp_path):
    with staged_output(tmp_path / "art") as scratch:
        (scratch / "w.bin").write_bytes(bytes(range(256)))
        write_manifest(scratch, "test")
    art = tmp_path / "art"
    assert read_manifest(art, verify=True)["files"]["w.bin"]["bytes"] == 256
    data = bytearray((art / "w.bin").read_bytes())
    data[17] ^= 0xFF
    (art / "w.bin").write_bytes(bytes(data))
    with pytest.raises(ArtifactIncompleteError, match="sha256 mismatch"):
        read_manifest(art, verify=True)
    (art / "manifest.json").unlink()
    with pytest.raises(ArtifactIncompleteError, match="no manifest.json"):
        read_manifest(art)


def test_missing_local_path_is_named():
    with pytest.raises(StorageError, match="/no/such/corpus.jsonl"):
        storage.localize("/no/such/corpus.jsonl", "/tmp")


@pytest.mark.s3
def test_s3_roundtrip_listing_and_localize(s3_env, tmp_path):
    bucket = s3_env
    base = f"s3://{bucket}/corpus"
    storage.write_bytes(f"{base}/a.jsonl", b'{"text": "x"}\n')
    storage.write_bytes(f"{base}/sub/b.jsonl", b'{"text": "y"}\n')
    assert storage.exists(base)
    assert storage.is_file(f"{base}/a.jsonl")
    assert not storage.is_file(base)
    assert storage.list_files(base) == ["a.jsonl", "sub/b.jsonl"]
    assert storage.read_bytes(f"{base}/sub/b.jsonl") == b'{"text": "y"}\n'
    assert list(storage.iter_lines(f"{base}/a.jsonl")) == [b'{"text": "x"}\n']
    single = storage.localize(f"{base}/a.jsonl", tmp_path / "one")
    assert single.read_bytes() == b'{"text": "x"}\n'
    tree = storage.localize(base, tmp_path / "tree")
    assert sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file()) == [
        "a.jsonl",
        "sub/b.jsonl",
    ]


@pytest.mark.s3
def test_s3_copy_tree_writes_manifest_last_and_multipart_large_files(s3_env, tmp_path):
    bucket = s3_env
    src = tmp_path / "src"
    src.mkdir()
    big = src / "big.bin"
    big.write_bytes(b"\x01" * (9 * 1024 * 1024))  # above boto3's 8 MiB multipart threshold
    (src / "small.txt").write_text("s")
    write_manifest(src, "test")
    order = storage.copy_tree(str(src), f"s3://{bucket}/release")
    assert order[-1] == "manifest.json"
    back = storage.localize(f"s3://{bucket}/release", tmp_path / "back")
    assert read_manifest(back, verify=True)["kind"] == "test"
    head = storage.s3_client().head_object(Bucket=bucket, Key="release/big.bin")
    assert "-" in head["ETag"]  # multipart uploads carry a part count in the ETag
    assert json.loads((back / "manifest.json").read_text())["files"]["big.bin"]["bytes"] == 9 * 1024 * 1024


@pytest.mark.s3
def test_s3_missing_object_is_a_clear_error(s3_env):
    with pytest.raises(StorageError, match=r"s3://.*/nope\.jsonl"):
        storage.read_bytes(f"s3://{s3_env}/nope.jsonl")


@pytest.mark.s3
def test_s3_exists_does_not_match_a_longer_sibling_prefix(s3_env):
    storage.write_bytes(f"s3://{s3_env}/models/v10/manifest.json", b"{}")
    assert storage.exists(f"s3://{s3_env}/models/v10")
    assert not storage.exists(f"s3://{s3_env}/models/v1")
