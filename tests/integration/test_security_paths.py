"""Hostile artifacts: names from manifests and S3 listings never map to a path outside their root; links are refused.

Every case checks the filesystem around the destination (all files under the test's directory, before and after)
so that a write outside the scratch root shows up whatever the error says. SeaweedFS normalizes ``//`` and refuses
``..`` in keys it stores; AWS S3 keeps them, so the listing cases add such keys to the real server's answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge import storage
from lmforge.artifacts import MANIFEST, read_manifest, write_manifest
from lmforge.data.corpus import CorpusReader
from lmforge.errors import InputDataError, UnsafePathError
from lmforge.launch.stage_runner import WORKDIR_ENV, fetch_artifact, publish_artifact

PAYLOAD = b"#!/bin/sh\necho pwned\n"


def _tree(root: Path) -> set[str]:
    """Every file and link under ``root`` (what a write anywhere below it would change)."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def _artifact(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "vocab.json").write_text('{"a": 0}')
    (root / "merges.txt").write_text("#version: 0.2\n")
    write_manifest(root, "tokenizer")
    return root


def _hostile_names(tmp_path: Path) -> dict[str, str]:
    return {
        "absolute": f"{tmp_path}/outside/PWNED.sh",
        "dotdot": "../PWNED.sh",
        "deep-dotdot": "a/../../../PWNED.sh",
        "empty-segment": "a//PWNED.sh",
        "dot": "./PWNED.sh",
        "backslash": "..\\PWNED.sh",
    }


@pytest.mark.s3
@pytest.mark.parametrize("kind", ["absolute", "dotdot", "deep-dotdot", "empty-segment", "dot", "backslash"])
def test_fetch_refuses_a_manifest_name_that_leaves_the_scratch_root(s3_env, tmp_path, kind):
    name = _hostile_names(tmp_path)[kind]
    uri = f"s3://{s3_env}/staging/cleaned"
    publish_artifact(_artifact(tmp_path / "src"), uri)
    manifest = json.loads(storage.read_bytes(f"{uri}/{MANIFEST}"))
    manifest["files"][name] = {"sha256": hashlib.sha256(PAYLOAD).hexdigest(), "bytes": len(PAYLOAD)}
    storage.write_bytes(f"{uri}/{MANIFEST}", json.dumps(manifest).encode())
    if kind in ("absolute", "empty-segment"):  # SeaweedFS refuses '..' and '.' keys; these it stores
        storage.write_bytes(storage.join(uri, name), PAYLOAD)
    dest = tmp_path / "fetch" / "cleaned"
    before = _tree(tmp_path)

    with pytest.raises(UnsafePathError) as err:
        fetch_artifact(uri, dest)

    assert repr(name) in str(err.value) and uri in str(err.value)
    assert _tree(tmp_path) == before
    assert not dest.exists() and not list((tmp_path / "fetch").iterdir())


@pytest.mark.s3
def test_stage_with_a_hostile_manifest_is_one_error_line_and_writes_nothing_outside(s3_env, s3_server, tmp_path):
    """An absolute object name through `lmforge stage tokenize --io cleaned=s3://...` with an absolute name."""
    uri = f"s3://{s3_env}/staging/cleaned"
    publish_artifact(_artifact(tmp_path / "src"), uri)
    name = f"{tmp_path}/outside/PWNED.sh"
    manifest = json.loads(storage.read_bytes(f"{uri}/{MANIFEST}"))
    manifest["files"][name] = {"sha256": hashlib.sha256(PAYLOAD).hexdigest(), "bytes": len(PAYLOAD)}
    storage.write_bytes(f"{uri}/{MANIFEST}", json.dumps(manifest).encode())
    storage.write_bytes(storage.join(uri, name), PAYLOAD)
    before = _tree(tmp_path)

    io = {"cleaned": uri, "tokenizer": tmp_path / "tok", "shards": tmp_path / "shards"}
    proc = subprocess.run(
        [sys.executable, "-m", "lmforge", "stage", "tokenize", *(f"--io={k}={v}" for k, v in io.items())],
        env={**os.environ, **s3_server.env(), WORKDIR_ENV: str(tmp_path / "work")},
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and name in errors[0], proc.stderr
    assert not Path(name).exists()
    # Only the download cache's lock file may appear, inside the stage's work directory.
    assert {p for p in _tree(tmp_path) - before if not p.startswith("work/lmforge-inputs/")} == set()
    assert [p.name for p in (tmp_path / "work").rglob("*") if not p.name.endswith(".lock")] == ["lmforge-inputs"]


def _inject_keys(bucket: str, keys: list[str]) -> None:
    """Add ``keys`` to every ListObjectsV2 answer of the real server, as AWS S3 would list them."""

    def add(parsed, **_):
        contents = parsed.setdefault("Contents", [])
        contents.extend({"Key": k, "Size": 5, "ETag": '"x"'} for k in keys if k.startswith(parsed.get("Prefix", "")))
        parsed["KeyCount"] = len(contents)

    storage.s3_client().meta.events.register("after-call.s3.ListObjectsV2", add)


@pytest.mark.s3
@pytest.mark.parametrize("kind", ["absolute", "dotdot", "deep-dotdot", "empty-segment", "dot", "backslash"])
def test_listing_with_a_hostile_key_is_refused_by_localize_and_the_corpus_reader(s3_env, tmp_path, kind):
    name = _hostile_names(tmp_path)[kind].replace(".sh", ".jsonl")
    uri = f"s3://{s3_env}/corpus"
    storage.write_bytes(f"{uri}/good.jsonl", b'{"text": "fine"}\n')
    if kind in ("absolute", "empty-segment"):
        storage.write_bytes(storage.join(uri, name), b'{"text": "pwned"}\n')
    _inject_keys(s3_env, [f"corpus/{name}"])
    before = _tree(tmp_path)

    with pytest.raises(UnsafePathError) as err:
        storage.list_files(uri)
    assert repr(name) in str(err.value) and uri in str(err.value)
    with pytest.raises(UnsafePathError, match="refusing file name"):
        storage.localize(uri, tmp_path / "work")
    with pytest.raises(UnsafePathError, match="refusing file name"):
        list(CorpusReader(uri))

    assert not (tmp_path / "outside").exists()
    assert _tree(tmp_path) == before


@pytest.mark.s3
def test_empty_folder_marker_objects_are_not_files(s3_env, tmp_path):
    uri = f"s3://{s3_env}/corpus"
    storage.write_bytes(f"{uri}/a.jsonl", b'{"text": "fine"}\n')
    storage.s3_client().put_object(Bucket=s3_env, Key="corpus/sub/", Body=b"")
    assert storage.list_files(uri) == ["a.jsonl"]


def test_local_copy_refuses_a_manifest_name_outside_its_root(tmp_path):
    art = _artifact(tmp_path / "art")
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t")
    manifest = json.loads((art / MANIFEST).read_text())
    manifest["files"][str(secret)] = {"sha256": hashlib.sha256(b"s3cr3t").hexdigest(), "bytes": 6}
    (art / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(UnsafePathError, match=f"refusing file name '{secret}': absolute path"):
        read_manifest(art, verify=True)


def _model_dir_with_link(tmp_path: Path, *, manifest_first: bool) -> tuple[Path, Path]:
    secret = tmp_path / "secret"
    secret.write_text("AWS_SECRET_ACCESS_KEY=do-not-publish\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "merges.txt").write_text("#version: 0.2\n")
    if manifest_first:  # the manifest was written, then the file was swapped for a link
        write_manifest(model, "model")
    (model / "merges.txt").unlink()
    (model / "merges.txt").symlink_to(secret)
    return model, secret


def test_describing_an_artifact_with_a_symlink_fails_naming_it(tmp_path):
    model, secret = _model_dir_with_link(tmp_path, manifest_first=False)
    with pytest.raises(UnsafePathError, match=f"merges.txt is a symbolic link \\(to {secret}\\)"):
        write_manifest(model, "model")
    assert not (model / MANIFEST).exists()


@pytest.mark.s3
def test_publishing_a_model_dir_with_a_symlink_fails_and_uploads_nothing(s3_env, tmp_path):
    model, _ = _model_dir_with_link(tmp_path, manifest_first=True)
    uri = f"s3://{s3_env}/models/m"
    with pytest.raises(UnsafePathError, match="'merges.txt'"):
        publish_artifact(model, uri)
    assert not storage.exists(uri)
    with pytest.raises(InputDataError, match="merges.txt"):
        read_manifest(model, verify=True)


def test_a_symlinked_directory_in_an_artifact_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "id_rsa").write_text("key")
    art = tmp_path / "art"
    art.mkdir()
    (art / "ok.txt").write_text("ok")
    (art / "sub").symlink_to(outside)
    with pytest.raises(UnsafePathError, match="sub is a symbolic link"):
        storage.copy_tree(str(art), str(tmp_path / "copy"))
    assert not (tmp_path / "copy").exists()


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("", "empty name"),
        ("/etc/passwd", "absolute path"),
        ("a/../b", "'..' path segment"),
        ("a//b", "empty path segment"),
        ("a/", "empty path segment"),
        ("a\\b", "backslash"),
        ("a\0b", "NUL byte"),
    ],
)
def test_safe_join_names_the_problem(tmp_path, name, problem):
    with pytest.raises(UnsafePathError, match=problem) as err:
        storage.safe_join(tmp_path, name, where="s3://b/p")
    assert str(err.value).startswith(f"s3://b/p: refusing file name {name!r}")


def test_safe_join_refuses_a_name_that_resolves_through_a_link(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "escape").symlink_to(tmp_path)
    with pytest.raises(UnsafePathError, match="resolves outside"):
        storage.safe_join(tmp_path / "root", "escape/x", where="m.json")
    assert storage.safe_join(tmp_path / "root", "a/b.txt", where="m.json") == tmp_path / "root" / "a" / "b.txt"
