"""Preflight checks a base model (and a pretrained student) before any stage starts, fingerprints it for the cache
keys of the stages that read it, and names the run's root the training steps put checkpoints under."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from lmforge.config import LaunchConfig
from lmforge.preflight import preflight
from lmforge.preflight.preflight import PreflightError, fingerprint_uri, run_checks
from lmforge_kfp.pipelines.compile import REPO_ROOT
from tests.support.foreign_base import gpt2_base, llama_base
from tests.unit.preflight.test_preflight import PREFLIGHT_OUTPUTS, _cache_keys, _corpus


@pytest.fixture(scope="module")
def bases(tmp_path_factory, shakespeare_docs) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    texts = [d["text"] for d in shakespeare_docs[:200]]
    return {"gpt2": gpt2_base(root / "gpt2", texts), "llama": llama_base(root / "llama", texts)}


def _checks(tmp_path: Path, **kw) -> preflight.PreflightReport:
    return run_checks(
        corpus_uri=str(_corpus(tmp_path)), qa_uri="demo://chatterbot", release_root=str(tmp_path / "reg"),
        s3_secret_name="", **kw,
    )  # fmt: skip


def test_a_base_written_by_save_pretrained_passes_and_is_fingerprinted_by_content(tmp_path, bases):
    report = _checks(tmp_path, base_model_uri=str(bases["gpt2"]))
    assert report.checks["base_model"] == "ok"
    assert report.fingerprints["base_model"] == fingerprint_uri(str(bases["gpt2"]))
    assert "student_base" not in report.checks and "student_base" not in report.fingerprints

    changed = shutil.copytree(bases["gpt2"], tmp_path / "changed")
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**config, "n_positions": 64}))
    changed_report = _checks(tmp_path, base_model_uri=str(changed))
    assert changed_report.fingerprints["base_model"] != report.fingerprints["base_model"]


def test_an_architecture_the_pipeline_cannot_train_fails_preflight_with_the_reason(tmp_path, bases):
    bert = shutil.copytree(bases["gpt2"], tmp_path / "bert")
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(PreflightError) as err:
        _checks(tmp_path, base_model_uri=str(bert))
    assert "base_model: " in str(err.value)
    assert "architecture 'bert' (BertForMaskedLM) is not supported" in str(err.value)
    assert "gpt2 and llama" in str(err.value)


def test_a_base_without_its_tokenizer_fails_preflight_naming_the_file(tmp_path, bases):
    bare = shutil.copytree(bases["llama"], tmp_path / "bare")
    (bare / "tokenizer.json").unlink()
    with pytest.raises(PreflightError, match=r"base_model: .*bare: no tokenizer\.json"):
        _checks(tmp_path, base_model_uri=str(bare))


def test_a_student_base_with_another_tokenizer_than_the_base_fails_preflight(tmp_path, bases):
    with pytest.raises(PreflightError) as err:
        _checks(tmp_path, base_model_uri=str(bases["gpt2"]), student_base_uri=str(bases["llama"]))
    message = str(err.value)
    assert "student_base_tokenizer: " in message and "vocabularies differ" in message
    assert "base_model: ok" not in message  # only failures are listed

    report = _checks(tmp_path, base_model_uri=str(bases["gpt2"]), student_base_uri=str(bases["gpt2"]))
    assert report.checks["student_base"] == report.checks["student_base_tokenizer"] == "ok"


def test_a_multi_node_launch_needs_the_base_on_s3(tmp_path, bases, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # no cluster: its check fails too, on its own
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    with pytest.raises(PreflightError) as err:
        _checks(tmp_path, base_model_uri=str(bases["gpt2"]), launch=LaunchConfig(num_nodes=2))
    assert "base_model: " in str(err.value) and "launch.num_nodes=2" in str(err.value)
    assert "must be an s3:// URI" in str(err.value)


@pytest.mark.s3
def test_a_base_on_s3_is_checked_from_its_config_and_tokenizer_files(tmp_path, bases, s3_env):
    from lmforge import storage

    uri = f"s3://{s3_env}/bases/llama"
    storage.copy_tree(str(bases["llama"]), uri)
    report = _checks(tmp_path, base_model_uri=uri, student_base_uri=uri)
    assert report.checks["base_model"] == report.checks["student_base_tokenizer"] == "ok"
    assert report.fingerprints["base_model"] == fingerprint_uri(uri)


def test_the_stage_returns_the_fingerprints_and_the_run_root(tmp_path, bases):
    common = dict(corpus_uri=str(_corpus(tmp_path)), qa_uri="demo://chatterbot", s3_secret_name="")
    release_root = str(tmp_path / "reg")
    summary = preflight.run(**common, release_root=release_root, base_model_uri=str(bases["llama"])).summary
    assert summary["base_model_fingerprint"] == fingerprint_uri(str(bases["llama"]))
    assert summary["student_base_fingerprint"] == ""
    assert summary["run_root"] == release_root  # no staging root: checkpoints go under the release root
    staged = preflight.run(**common, release_root=release_root, staging_uri="s3://bucket/staging").summary
    assert staged["run_root"] == "s3://bucket/staging" and staged["base_model_fingerprint"] == ""


def test_a_changed_base_model_changes_the_cache_key_of_every_stage_that_reads_it():
    spec = next(yaml.safe_load_all((REPO_ROOT / "pipelines/compiled/lmforge_pipeline.yaml").read_text()))
    params = {name: p.get("defaultValue") for name, p in spec["root"]["inputDefinitions"]["parameters"].items()}
    params["base_model_uri"] = "s3://models/base"
    before = _cache_keys(spec, params, PREFLIGHT_OUTPUTS)
    after = _cache_keys(spec, params, {**PREFLIGHT_OUTPUTS, "base_model_fingerprint": "changed"})
    changed = {task for task in before if before[task] != after[task]}
    assert {"tokenize", "pretrain", "finetune-lora", "distill", "evaluate"} <= changed
    assert not changed & {"clean-shard", "merge-shards", "dedup-union"}  # cleaning does not read the base
