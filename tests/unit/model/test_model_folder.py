"""Model folders from outside: no custom code runs and no weights are read from outside the folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from lmforge.artifacts import write_manifest
from lmforge.errors import InputDataError
from lmforge.model.base import check_base_model, model_record
from lmforge.model.build import load_causal_lm
from tests.support.foreign_base import gpt2_base

_EVIL_CODE = """
from pathlib import Path
Path({marker!r}).write_text("the model folder's code ran")
from transformers import GPT2Config, GPT2LMHeadModel
class EvilConfig(GPT2Config):
    model_type = "evil_gpt"
class EvilModel(GPT2LMHeadModel):
    config_class = EvilConfig
"""

_LOAD_BASE = """
import sys
from lmforge.errors import InputDataError
from lmforge.train.finetune_lora import load_base
try:
    load_base(sys.argv[1], sys.argv[2])
except InputDataError as exc:
    print("REFUSED", exc)
"""


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, shakespeare_docs) -> Path:
    return gpt2_base(tmp_path_factory.mktemp("gpt2-base"), [d["text"] for d in shakespeare_docs])


def _custom_code_base(gpt2_dir: Path, out: Path, marker: Path) -> Path:
    shutil.copytree(gpt2_dir, out)
    config = json.loads((out / "config.json").read_text())
    config |= {
        "model_type": "evil_gpt",
        "architectures": ["EvilModel"],
        "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"},
    }
    (out / "config.json").write_text(json.dumps(config))
    (out / "evil.py").write_text(_EVIL_CODE.format(marker=str(marker)))
    return out


@pytest.mark.slow
def test_a_stage_loading_a_base_with_auto_map_refuses_it_and_never_asks_to_run_its_code(tmp_path, gpt2_dir):
    marker = tmp_path / "PWNED"
    base = _custom_code_base(gpt2_dir, tmp_path / "base", marker)
    # what finetune_lora does with --io base_model=DIR, in a child whose stdin answers transformers' prompt "y"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_BASE, str(base), str(tmp_path / "work")],
        input="y\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert not marker.exists(), "the model folder's code ran"
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "trust_remote_code" not in proc.stderr  # no prompt
    [refusal] = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED")]
    assert f"model directory {base}: config.json has auto_map (AutoConfig, AutoModelForCausalLM)" in refusal


def test_preflight_names_auto_map_in_the_tokenizer_config_too(tmp_path, gpt2_dir):
    base = shutil.copytree(gpt2_dir, tmp_path / "base")
    tok_config = json.loads((base / "tokenizer_config.json").read_text())
    tok_config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (base / "tokenizer_config.json").write_text(json.dumps(tok_config))
    assert "tokenizer_config.json has auto_map (AutoTokenizer)" in check_base_model(str(base))
    with pytest.raises(InputDataError, match="tokenizer_config.json has auto_map"):
        load_causal_lm(base)


def _sharded_outside(gpt2_dir: Path, root: Path) -> Path:
    """A base whose index maps every tensor to ``../elsewhere.safetensors``, a file beside the folder."""
    base = shutil.copytree(gpt2_dir, root / "base")
    weights = base / "model.safetensors"
    with safe_open(weights, "pt") as fh:
        names = list(fh.keys())
    index = {
        "metadata": {"total_size": weights.stat().st_size},
        "weight_map": dict.fromkeys(names, "../elsewhere.safetensors"),
    }
    (base / "model.safetensors.index.json").write_text(json.dumps(index))
    weights.rename(root / "elsewhere.safetensors")
    return base


def test_a_weight_index_naming_a_file_outside_the_folder_is_refused_naming_it(tmp_path, gpt2_dir):
    base = _sharded_outside(gpt2_dir, tmp_path)
    with pytest.raises(InputDataError, match=r"refusing file name '\.\./elsewhere\.safetensors': '\.\.' path segment"):
        load_causal_lm(base)
    reason = check_base_model(str(base))
    assert "'../elsewhere.safetensors'" in reason and "inside the model folder" in reason


def test_a_weight_file_missing_from_the_folders_manifest_is_refused(tmp_path, gpt2_dir):
    base = shutil.copytree(gpt2_dir, tmp_path / "base")
    weights = base / "model.safetensors"
    with safe_open(weights, "pt") as fh:
        names = list(fh.keys())
    weights.rename(base / "model-00001-of-00001.safetensors")
    write_manifest(base, "model")  # the fingerprint covers what the manifest lists ...
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")}
    (base / "model.safetensors.index.json").write_text(json.dumps(index))  # ... which is not the index
    with pytest.raises(InputDataError, match="model.safetensors.index.json not listed in manifest.json"):
        load_causal_lm(base)
    write_manifest(base, "model")
    assert load_causal_lm(base).config.n_layer == 2
    assert model_record(base, str(base))["fingerprint"]
