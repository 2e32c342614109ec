"""A new user's mistakes, each made with the real ``lmforge`` command: exit code 2, the last line one ``error:`` line
naming the cause (and the hint), the input mistakes caught by preflight before any stage, within 30 s, no traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each data mistake starts kfp.local and its preflight task


def _jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def _scenes(tmp_path: Path, shakespeare_docs, field: str = "text") -> str:
    return _jsonl(tmp_path / "scenes.jsonl", [{field: d["text"]} for d in shakespeare_docs[:5]])


MISTAKES = {
    "missing corpus file": (lambda t, d: ["--corpus", str(t / "nope.jsonl")], ["nope.jsonl"], True),
    "empty corpus": (lambda t, d: ["--corpus", _jsonl(t / "empty.jsonl", [])], ["empty.jsonl", "no documents"], True),
    "text under another field": (
        lambda t, d: ["--corpus", _scenes(t, d, field="content")],
        ["clean.text_field", "'content'"],
        True,
    ),
    "Q&A with question/answer fields": (
        lambda t, d: ["--corpus", _scenes(t, d), "--qa", _jsonl(t / "qa.jsonl", [{"question": "q?", "answer": "a"}])],
        ["question", "prompt", "answer", "response"],
        True,
    ),
    "s3 without an endpoint": (
        lambda t, d: ["--corpus", "s3://lmforge-nowhere/raw/corpus.jsonl"],
        ["AWS_ENDPOINT_URL"],
        True,
    ),
    "typo in a stage name": (lambda t, d: ["--set", "pretrian.train.max_steps=1"], ["did you mean 'pretrain'"], False),
    "typo in a field name": (lambda t, d: ["--set", "pretrain.train.max_step=1"], ["did you mean 'max_steps'"], False),
    "wrong type of value": (
        lambda t, d: ["--set", "pretrain.train.max_steps=true"],
        ["pretrain.train.max_steps"],
        False,
    ),
    "unknown preset": (lambda t, d: ["--preset", "gpt2-125m"], ["unknown preset 'gpt2-125m'", "gpt2-124m"], False),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_mistake_ends_in_one_error_line_with_the_cause_early_and_without_a_traceback(
    mistake, tmp_path, shakespeare_docs
):
    args, named, in_preflight = MISTAKES[mistake]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_EC2_METADATA_DISABLED": "true"}
    command = [
        sys.executable,
        "-m",
        "lmforge",
        "run",
        "--output",
        str(tmp_path / "out"),
        *args(tmp_path, shakespeare_docs),
    ]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    elapsed = time.monotonic() - start
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), output
    for word in named:
        assert word in last, last
    assert "Traceback" not in output
    assert elapsed < 30, f"{mistake}: {elapsed:.0f} s"
    if in_preflight:
        assert "preflight" in last
        logs = list((tmp_path / "out").glob("runs/*/logs/*.log"))
        ran = {p.stem for p in logs} - {"run"}
        assert ran == {"preflight"}, ran  # no stage started before the checks failed
    else:
        assert not (tmp_path / "out").exists()  # refused before anything ran
