"""The ``pretrain`` stage on the tiny corpus: loss goes down and the output is a usable HF model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmforge.artifacts import read_manifest
from lmforge.contracts import HISTORY_FILE
from lmforge.errors import InputDataError
from lmforge.model.build import load_tokenizer
from lmforge.train import pretrain
from tests.support.tiny_training import tiny_pretrain
from tests.support.token_shards import shards_of_another_tokenizer

CFG = tiny_pretrain(max_steps=30, batch_size=8, warmup_steps=5, eval_interval=10, eval_batches=2, log_interval=5)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_shards_dir, tiny_tokenizer_dir) -> tuple[Path, Path]:
    return (
        tiny_shards_dir,
        tiny_tokenizer_dir,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory, inputs):
    out = tmp_path_factory.mktemp("pretrain") / "model"
    return pretrain.run(CFG, shards=inputs[0], tokenizer=inputs[1], model=out), out


def test_pretraining_lowers_train_and_validation_loss(trained):
    result, out = trained
    history = json.loads((out / HISTORY_FILE).read_text())
    assert history["eval_step"] == [0, 10, 20, 30]
    assert history["eval_loss"][-1] < history["eval_loss"][0] - 0.3
    assert history["train_loss"][-1] < history["train_loss"][0]
    assert result.metrics["val_loss"] == history["eval_loss"][-1]
    assert result.metrics["val_perplexity"] == pytest.approx(torch.tensor(result.metrics["val_loss"]).exp())
    assert result.metrics["steps"] == 30 and result.metrics["tokens_per_sec"] > 0


def test_saved_model_loads_with_transformers_and_generates(trained, inputs):
    _, out = trained
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = load_tokenizer(out)
    prompt = tokenizer("ROMEO:", return_tensors="pt")["input_ids"]
    generated = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert generated.shape == (1, prompt.shape[1] + 6)
    assert model.config.n_layer == 2 and model.config.vocab_size == len(tokenizer)


def test_output_manifest_records_inputs_config_and_metrics(trained):
    result, out = trained
    manifest = read_manifest(out, verify=True)
    assert manifest["kind"] == "model"
    assert set(manifest["inputs"]) == {"shards", "tokenizer"}
    assert manifest["config"]["train"]["max_steps"] == 30
    assert set(manifest["metrics"]) == {
        "train_loss", "val_loss", "val_perplexity", "tokens_per_sec", "parameters", "steps", "bad_steps", "world_size",
    }  # fmt: skip  # no "mfu": the CPU has no configured peak
    assert result.html.count("<img") == 2


def test_shards_from_another_tokenizer_are_refused(tmp_path, inputs):
    shards, tokenizer = inputs
    other = shards_of_another_tokenizer(shards, tmp_path / "shards")
    with pytest.raises(InputDataError, match="were written by tokenizer ffffffffffff"):
        pretrain.run(CFG, shards=other, tokenizer=tokenizer, model=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_occupied_output_is_refused_before_training(tmp_path, inputs, monkeypatch):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("earlier result")
    monkeypatch.setattr(pretrain, "train", lambda *a, **k: pytest.fail("trained despite occupied output"))
    with pytest.raises(InputDataError, match="already exists and is not empty"):
        pretrain.run(CFG, shards=inputs[0], tokenizer=inputs[1], model=tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "earlier result"


def test_tensorboard_event_files_are_written_next_to_the_model(trained):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out = trained
    events = EventAccumulator(str(out / pretrain.TENSORBOARD_DIR))
    events.Reload()
    assert {"loss/train", "loss/eval", "lr", "grad_norm", "tokens_per_sec"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("loss/eval")] == [0, 10, 20, 30]
