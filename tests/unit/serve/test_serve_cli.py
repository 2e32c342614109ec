"""``lmforge serve``: its arguments checked before anything loads, and a release on S3 fetched as only what it serves.

The command serving a real release end to end (the one the demo summary prints) runs in test_pipeline_local.py,
on the release the DAG promoted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lmforge import storage
from lmforge.cli import application
from lmforge.onnx_runtime import NO_PAST_FILE, WITH_PAST_FILE
from lmforge.serve.model_dir import fetch_release

runner = CliRunner()


def _error_line(args: list[str]) -> str:
    result = runner.invoke(application(), args, terminal_width=300)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return [line for line in result.output.strip().splitlines() if line.strip()][-1]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["serve", "x", "--set", "pretrain.train.lr=1"], "lmforge serve reads only the serve section"),
        (["serve", "x", "--set", "serve.max_batch_size=0"], "serve.max_batch_size"),
        (["serve", "x", "--set", "serve.max_batch=4"], "did you mean 'max_batch_size'?"),
        (["serve", "x", "--set", "srve.apply=true"], "did you mean 'serve'?"),
    ],
)
def test_a_bad_setting_fails_in_one_error_line_before_the_server_starts(args: list[str], named: str) -> None:
    line = _error_line(args)
    assert line.startswith("error: ") and named in line


def test_a_path_that_is_no_model_fails_in_one_error_line(tmp_path: Path) -> None:
    line = _error_line(["serve", str(tmp_path / "absent"), "--port", "18080"])
    assert line.startswith("error: model path not found") and "absent" in line
    (tmp_path / "empty").mkdir()
    assert f"no {WITH_PAST_FILE}" in _error_line(["serve", str(tmp_path / "empty")])


def _put_release(prefix: str, folders: dict[str, list[str]]) -> None:
    manifest = {"kind": "release", "model_name": "demo", "version": "v1", "artifacts": {f: {} for f in folders}}
    storage.write_bytes(storage.join(prefix, "manifest.json"), json.dumps(manifest).encode())
    for folder, files in folders.items():
        for name in files:
            storage.write_bytes(storage.join(prefix, folder, name), f"{folder}/{name}".encode())


def test_a_release_on_s3_is_fetched_as_its_manifest_and_the_one_folder_it_serves(s3_env: str, tmp_path: Path) -> None:
    prefix = f"s3://{s3_env}/registry/models/demo/v1"
    onnx = [WITH_PAST_FILE, NO_PAST_FILE, "config.json", "tokenizer.json"]
    _put_release(prefix, {"student": ["model.safetensors"], "onnx_fp32": onnx, "int8_dynamic": onnx})
    local = fetch_release(prefix, tmp_path / "a")
    fetched = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    assert fetched == sorted(["manifest.json", *(f"int8_dynamic/{name}" for name in onnx)])
    assert (local / "int8_dynamic" / "config.json").read_text() == "int8_dynamic/config.json"
    fp32 = fetch_release(prefix, tmp_path / "b", prefer_int8=False)
    assert sorted(p.name for p in fp32.iterdir()) == ["manifest.json", "onnx_fp32"]
    assert fetch_release(str(tmp_path), tmp_path / "c") == tmp_path  # local: used in place
