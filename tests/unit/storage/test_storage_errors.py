"""Disk errors are one line naming the path with no temporary file left; scratch of killed processes is removed."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lmforge import storage
from lmforge.artifacts import staged_output
from lmforge.errors import StorageError


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True, timeout=30
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs `unshare -m` and mount rights for a private 64 KiB tmpfs")
def test_a_full_disk_is_one_error_line_naming_the_path_and_leaves_nothing(tmp_path, shakespeare_docs):
    corpus = tmp_path / "raw.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in shakespeare_docs))
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "cleaned"
    script = textwrap.dedent(f"""
        mount -t tmpfs -o size=64k tmpfs {disk} || exit 99
        {sys.executable} -m lmforge stage clean --io corpus_uri={corpus} --io cleaned={out}
        echo "EXIT=$?"
        echo "LEFT:"; find {disk} -mindepth 1
    """)
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=300)

    assert "EXIT=2" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    print(errors[0])
    assert f"cannot write {disk}/" in errors[0] and "No space left on device" in errors[0]
    assert "Traceback" not in proc.stderr
    assert proc.stdout.split("LEFT:", 1)[1].split() == []  # no .tmp, no partial output, no scratch dir


def _fail_fsync(_fd):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_injected_enospc_in_a_write_names_the_path_and_leaves_no_tmp(tmp_path, monkeypatch):
    target = tmp_path / "out" / "manifest.json"
    monkeypatch.setattr(os, "fsync", _fail_fsync)
    with pytest.raises(StorageError, match=f"^cannot write {target}: No space left on device$"):
        storage.write_bytes(str(target), b"{}")
    assert list((tmp_path / "out").iterdir()) == []


def test_enospc_while_staging_an_output_names_the_output_and_removes_the_scratch(tmp_path):
    final = tmp_path / "cleaned"
    with (
        pytest.raises(StorageError, match=f"^cannot write {final}: No space left on device$"),
        staged_output(final) as s,
    ):
        (s / "part-0.parquet").write_bytes(b"x")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(s / "part-0.parquet"))
    assert list(tmp_path.iterdir()) == []


_KILLED_IN = """
import os, signal, sys
from pathlib import Path
from lmforge.config import CleanConfig
from lmforge.data import clean, dedup_shards

def stop_here(*args, **kwargs):
    Path(sys.argv[3]).write_text("ready")
    if sys.argv[4] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    signal.pause()

dedup_shards.run = stop_here
clean.run(CleanConfig(), corpus_uri=sys.argv[1], cleaned=sys.argv[2])
"""


def _clean_child(corpus: Path, out: Path, ready: Path, mode: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", _KILLED_IN, str(corpus), str(out), str(ready), mode])
    while not ready.exists() and child.poll() is None:
        time.sleep(0.05)
    return child


def test_scratch_of_a_killed_clean_is_removed_on_the_next_start_and_a_live_one_is_kept(tmp_path, shakespeare_docs):
    corpus = tmp_path / "raw.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in shakespeare_docs[:5]))
    runs = tmp_path / "runs"
    killed = _clean_child(corpus, runs / "a", tmp_path / "ready-a", "kill")
    assert killed.wait(timeout=120) == -signal.SIGKILL
    stale = [p.name for p in runs.iterdir() if p.name.startswith(".lmforge-clean-")]
    assert len(stale) == 1  # what SIGKILL leaves behind
    live = _clean_child(corpus, runs / "b", tmp_path / "ready-b", "wait")
    try:
        live_dirs = {p.name for p in runs.iterdir() if p.name.startswith(".lmforge-clean-")} - set(stale)
        assert len(live_dirs) == 1

        from lmforge.config import CleanConfig
        from lmforge.data import clean

        clean.run(CleanConfig(), corpus_uri=str(corpus), cleaned=runs / "c")

        left = {p.name for p in runs.iterdir()}
        assert stale[0] not in left  # the killed run's scratch is gone
        assert live_dirs <= left  # the running one's is untouched
    finally:
        live.kill()
        live.wait()


def test_fetch_scratch_of_a_killed_process_is_removed_on_the_next_start(tmp_path):
    final = tmp_path / "inputs" / "abc"
    code = (
        "import os, signal, sys\n"
        "from lmforge.artifacts import staged_output\n"
        "with staged_output(sys.argv[1]) as s:\n"
        "    (s / 'half.bin').write_bytes(b'x' * 1000)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    assert subprocess.run([sys.executable, "-c", code, str(final)], timeout=60).returncode == -signal.SIGKILL
    assert len(list(final.parent.iterdir())) == 1  # the partial download
    with staged_output(final) as scratch:
        (scratch / "whole.bin").write_bytes(b"y")
    assert [p.name for p in final.parent.iterdir()] == ["abc"]
    assert [p.name for p in final.iterdir()] == ["whole.bin"]
