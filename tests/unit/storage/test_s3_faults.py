"""The S3 server goes away in the middle of writing an artifact: retries carry the write through a restart,
or it fails with a clear error; a prefix without a valid manifest is never read as complete."""

import threading

import pytest

from lmforge import storage
from lmforge.artifacts import read_manifest, write_manifest
from lmforge.errors import ArtifactIncompleteError, StorageError

pytestmark = [pytest.mark.s3, pytest.mark.slow]


@pytest.fixture
def artifact(tmp_path):
    """A local artifact of 12 files plus its manifest."""
    root = tmp_path / "art"
    root.mkdir()
    for i in range(12):
        (root / f"part-{i:05d}.bin").write_bytes(bytes([i]) * 50_000)
    write_manifest(root, "test")
    return root


def _stop_server_after(monkeypatch, server, files: int, restart_after_s: float | None):
    """Stop the server once ``files`` uploads have gone through; optionally restart it in the background."""
    real_upload = storage.upload_file
    count = {"n": 0}

    def upload(local, uri):
        if count["n"] == files:
            server.stop()
            if restart_after_s is not None:
                threading.Timer(restart_after_s, server.start).start()
        count["n"] += 1
        real_upload(local, uri)

    monkeypatch.setattr(storage, "upload_file", upload)


def test_a_crash_mid_write_fails_clearly_and_leaves_no_complete_looking_prefix(
    s3_server, s3_env, artifact, tmp_path, monkeypatch
):
    monkeypatch.setenv("LMFORGE_S3_MAX_ATTEMPTS", "2")
    storage.s3_client.cache_clear()
    _stop_server_after(monkeypatch, s3_server, files=5, restart_after_s=None)
    target = f"s3://{s3_env}/releases/r1"
    try:
        with pytest.raises(StorageError, match=r"s3://.*/releases/r1/part-0000\d\.bin"):
            storage.copy_tree(str(artifact), target)
    finally:
        s3_server.start()
        storage.s3_client.cache_clear()
    names = storage.list_files(target)
    assert 0 < len(names) < 13 and "manifest.json" not in names
    with pytest.raises(ArtifactIncompleteError, match="no manifest.json"):
        read_manifest(storage.localize(target, tmp_path / "partial"))


def test_retries_carry_a_write_through_a_server_restart(s3_server, s3_env, artifact, tmp_path, monkeypatch):
    _stop_server_after(monkeypatch, s3_server, files=4, restart_after_s=1.0)
    target = f"s3://{s3_env}/releases/r2"
    storage.copy_tree(str(artifact), target)
    assert s3_server.process is not None
    back = storage.localize(target, tmp_path / "back")
    assert read_manifest(back, verify=True)["kind"] == "test"


def test_a_flipped_byte_in_an_s3_object_is_caught_by_the_checksum(s3_env, artifact, tmp_path):
    target = f"s3://{s3_env}/releases/r3"
    storage.copy_tree(str(artifact), target)
    key = f"{target}/part-00007.bin"
    data = bytearray(storage.read_bytes(key))
    data[1234] ^= 0x40
    storage.write_bytes(key, bytes(data))
    with pytest.raises(ArtifactIncompleteError, match=r"part-00007\.bin: sha256 mismatch"):
        read_manifest(storage.localize(target, tmp_path / "flipped"), verify=True)
