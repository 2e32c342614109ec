"""What lmforge writes loads where transformers 4.x is installed, as optimum[onnxruntime] installs it (a separate
environment, tests/support/optimum_env.py): the tokenizer and the model with AutoTokenizer and AutoModelForCausalLM,
and the exported ONNX directory in optimum's ORTModelForCausalLM as optimum's documentation loads it (no file_name),
generating with its KV cache the tokens it generates without one and the tokens transformers generates from the
PyTorch model, with no warning that the graph is a legacy one."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from lmforge.config import ExportConfig
from lmforge.export.export_onnx import run as export_onnx
from tests.support.optimum_env import optimum_python
from tests.support.serve_helpers import redraw_weights

pytestmark = pytest.mark.slow

CONSUMER = textwrap.dedent(
    """
    import json, sys
    import torch, transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from optimum.onnxruntime import ORTModelForCausalLM

    model_dir, onnx_dir = sys.argv[1:3]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    batch = tokenizer(["KING: my lord", "a"], return_tensors="pt", padding=True)
    greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    torch_model = AutoModelForCausalLM.from_pretrained(model_dir)
    ort_model = ORTModelForCausalLM.from_pretrained(onnx_dir)
    print(json.dumps({
        "transformers": transformers.__version__,
        "tokenizer": type(tokenizer).__name__,
        "inputs": sorted(batch),
        "can_use_cache": ort_model.can_use_cache,
        "torch": torch_model.generate(**batch, **greedy).tolist(),
        "ort_cache": ort_model.generate(**batch, **greedy, use_cache=True).tolist(),
        "ort_no_cache": ort_model.generate(**batch, **greedy, use_cache=False).tolist(),
    }))
    """
)


@pytest.fixture(scope="module")
def python() -> str:
    path, why = optimum_python()
    if path is None:
        pytest.skip(why)
    return path


@pytest.fixture(scope="module")
def released(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A model (weights redrawn so that greedy tokens vary) and its ONNX export, as the pipeline writes them."""
    model = redraw_weights(tiny_model_dir, tmp_path_factory.mktemp("consumer-model"))
    onnx = tmp_path_factory.mktemp("consumer") / "onnx"
    export_onnx(ExportConfig(), model=model, onnx_model=onnx)
    return model, onnx


def test_transformers_4_and_optimum_load_the_tokenizer_model_and_onnx_and_generate_with_the_kv_cache(python, released):
    model, onnx = released
    done = subprocess.run([python, "-c", CONSUMER, str(model), str(onnx)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["transformers"].startswith("4."), seen
    assert seen["tokenizer"] == "PreTrainedTokenizerFast" and seen["inputs"] == ["attention_mask", "input_ids"]
    assert seen["can_use_cache"] is True
    assert "legacy" not in done.stderr, done.stderr[-3000:]
    assert seen["ort_cache"] == seen["ort_no_cache"] == seen["torch"]
    assert len({tuple(row) for row in seen["torch"]}) == 2  # two prompts, two continuations
