"""The CLI names bad input in one line and exits non-zero before doing any work."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from lmforge.cli import application

runner = CliRunner()


def _error_line(result) -> str:
    """The one ``error:`` line (progress logs may surround it on stderr)."""
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("error:")]
    assert len(errors) == 1, result.output
    return lines[errors[0]]


def test_run_rejects_a_bad_override_before_running(tmp_path):
    result = runner.invoke(application(), ["run", "--output", str(tmp_path), "--set", "pretrain.train.max_steps=true"])
    assert "pretrain.train.max_steps" in _error_line(result)
    assert list(tmp_path.iterdir()) == []


def test_run_rejects_an_unknown_preset(tmp_path):
    result = runner.invoke(application(), ["run", "--output", str(tmp_path), "--preset", "gpt-9"])
    assert "unknown preset 'gpt-9'" in _error_line(result)


def test_run_rejects_an_unknown_stage_in_overrides(tmp_path):
    result = runner.invoke(application(), ["run", "--output", str(tmp_path), "--set", "pretrian.train.lr=0.1"])
    assert "pretrian.train.lr" in _error_line(result)


def test_stage_missing_corpus_is_named_and_writes_nothing(tmp_path):
    out = tmp_path / "cleaned"
    result = runner.invoke(
        application(), ["stage", "clean", "--io", f"corpus_uri={tmp_path}/missing.jsonl", "--io", f"cleaned={out}"]
    )
    assert "missing.jsonl" in _error_line(result)
    assert not out.exists()


def test_stage_non_json_line_is_named_with_file_and_line(tmp_path):
    corpus = tmp_path / "raw.jsonl"
    corpus.write_text(json.dumps({"text": "a perfectly fine document with words"}) + "\n{oops\n")
    out = tmp_path / "cleaned"
    result = runner.invoke(application(), ["stage", "clean", "--io", f"corpus_uri={corpus}", "--io", f"cleaned={out}"])
    assert "raw.jsonl:2" in _error_line(result)
    assert not out.exists()


def test_stage_empty_corpus_is_named(tmp_path):
    corpus = tmp_path / "empty.jsonl"
    corpus.write_text("")
    result = runner.invoke(
        application(), ["stage", "clean", "--io", f"corpus_uri={corpus}", "--io", f"cleaned={tmp_path / 'o'}"]
    )
    assert "empty.jsonl" in _error_line(result)


def test_stage_runs_clean_and_prints_metrics(tmp_path, shakespeare_docs):
    corpus = tmp_path / "raw.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in shakespeare_docs[:5]))
    result = runner.invoke(
        application(), ["stage", "clean", "--io", f"corpus_uri={corpus}", "--io", f"cleaned={tmp_path / 'o'}"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["metrics"]["docs_out"] == 5


def test_config_prints_resolved_yaml():
    result = runner.invoke(application(), ["config", "--set", "distill.temperature=3.0"])
    assert result.exit_code == 0
    assert "temperature: 3.0" in result.output


@pytest.mark.slow
def test_run_names_the_failed_task_in_one_line(tmp_path):
    """A stage failing inside the local DAG (here: no corpus) ends in one error line naming the task."""
    result = runner.invoke(application(), ["run", "--output", str(tmp_path), "--corpus", str(tmp_path / "none.jsonl")])
    line = _error_line(result)
    assert "(task preflight;" in line and "none.jsonl" in line  # the task's own cause, and which task it was
