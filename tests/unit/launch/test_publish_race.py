"""Concurrent publishers to one artifact prefix cannot tear it (docs/security.md, M3)."""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lmforge import storage
from lmforge.artifacts import PUBLISH_CLAIM, read_manifest, write_manifest
from lmforge.errors import ArtifactConflictError
from lmforge.launch.stage_runner import fetch_artifact, publish_artifact

PUBLISHERS = 20


def _artifact(folder: Path, i: int) -> Path:
    folder.mkdir()
    (folder / "weights.bin").write_bytes(bytes([i]) * 300_000)
    (folder / "config.json").write_text(json.dumps({"publisher": i}))
    write_manifest(folder, "model", extra={"publisher": i})
    return folder


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_twenty_concurrent_publishers_to_one_prefix_exactly_one_wins_and_its_manifest_verifies(
    where, tmp_path, request
):
    sources = [_artifact(tmp_path / f"source-{i}", i) for i in range(PUBLISHERS)]
    if where == "s3":
        uri = f"s3://{request.getfixturevalue('s3_env')}/staging/run-1/task/model"
    else:
        uri = str(tmp_path / "staging" / "model")
    start = threading.Barrier(PUBLISHERS)

    def publish(source: Path) -> bool | Exception:
        start.wait()
        try:
            return publish_artifact(source, uri)
        except ArtifactConflictError as exc:
            return exc

    with ThreadPoolExecutor(PUBLISHERS) as pool:
        outcomes = list(pool.map(publish, sources))

    winners = [i for i, outcome in enumerate(outcomes) if outcome is True]
    assert len(winners) == 1, outcomes
    losers = [outcome for i, outcome in enumerate(outcomes) if i != winners[0]]
    assert all(isinstance(o, ArtifactConflictError) and uri in str(o) for o in losers), losers
    copy = fetch_artifact(uri, tmp_path / "copy")  # every file checked against the survivor's manifest
    assert copy["publisher"] == winners[0]
    assert (tmp_path / "copy" / "weights.bin").read_bytes() == bytes([winners[0]]) * 300_000
    assert json.loads(storage.read_bytes(storage.join(uri, "config.json"))) == {"publisher": winners[0]}


def test_a_retry_of_the_same_artifact_after_a_publisher_died_completes_it(tmp_path, tiny_tokenizer_dir):
    remote = tmp_path / "remote" / "tokenizer"
    manifest = (tiny_tokenizer_dir / "manifest.json").read_bytes()
    claim = {"manifest_sha256": hashlib.sha256(manifest).hexdigest(), "claimed_at": "earlier"}
    remote.mkdir(parents=True)
    (remote / PUBLISH_CLAIM).write_text(json.dumps(claim))  # the first attempt died after claiming
    (remote / "tokenizer.json").write_text("half")

    assert publish_artifact(tiny_tokenizer_dir, str(remote)) is True
    assert read_manifest(remote, verify=True) == read_manifest(tiny_tokenizer_dir)
