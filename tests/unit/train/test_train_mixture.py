"""Task-aware distillation: corpus windows and fine-tuning examples in each batch, held-out examples never in one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lmforge.artifacts import read_manifest, write_manifest
from lmforge.config import DistillConfig, TrainConfig
from lmforge.data.qa import QALineage, load_examples, split_examples
from lmforge.errors import ConfigError
from lmforge.formats.token_shards import TokenShards
from lmforge.model.build import load_tokenizer
from lmforge.train import distill
from lmforge.train.batches import IGNORE_INDEX
from lmforge.train.mixture import Mixture, load_qa_rows, mixture_batches, plan_mixture, trained_on

TRAIN = TrainConfig(
    max_steps=6, batch_size=4, seq_len=32, lr=3e-3, min_lr=3e-4, warmup_steps=1, precision="fp32",
    eval_interval=3, eval_batches=2, log_interval=3,
)  # fmt: skip
FRACTION = 0.2  # the held-out fraction "LoRA" recorded in the teacher's manifest below


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tiny_model_dir, qa_jsonl) -> Path:
    """The tiny model with what the LoRA stage records: the Q&A data and its held-out fraction."""
    out = tmp_path_factory.mktemp("teacher") / "teacher"
    shutil.copytree(tiny_model_dir, out)
    (out / "manifest.json").unlink()
    write_manifest(
        out,
        "model",
        inputs={"qa": {"uri": str(qa_jsonl), "kind": "qa_examples"}},
        config={"heldout_fraction": FRACTION, "chat_template": "auto", "split_long_examples": True},
    )
    return out


@pytest.fixture(scope="module")
def qa_rows(tiny_tokenizer_dir, qa_jsonl):
    lineage = QALineage(str(qa_jsonl), FRACTION)
    return load_qa_rows(str(qa_jsonl), load_tokenizer(tiny_tokenizer_dir), lineage, width=33, heldout_limit=8)


@pytest.mark.parametrize(
    ("fraction", "batch", "corpus", "examples"),
    [(0.5, 16, 8, 8), (0.1, 4, 3, 1), (0.9, 4, 1, 3), (1.0, 16, 0, 16), (0.0, 16, 16, 0)],
)
def test_each_micro_batch_holds_round_fraction_rows_of_examples_and_at_least_one_of_each(
    qa_rows, fraction, batch, corpus, examples
):
    mixture = plan_mixture(fraction, batch, qa_rows)
    assert (mixture.corpus_rows, mixture.qa_rows) == (corpus, examples)


def test_without_examples_the_mixture_is_corpus_only_and_says_why():
    mixture = plan_mixture(0.5, 8, None)
    assert (mixture.qa_fraction, mixture.corpus_rows, mixture.qa_rows) == (0.0, 8, 0)
    assert mixture.reason == "no Q&A data given or recorded in the teacher's manifest"


def test_a_mixture_needs_two_rows_per_micro_batch(qa_rows):
    with pytest.raises(ConfigError, match="needs train.batch_size >= 2"):
        plan_mixture(0.5, 1, qa_rows)


def test_the_loss_weighs_each_part_by_the_fraction_over_its_own_tokens():
    mixture = Mixture(qa_fraction=0.25, corpus_rows=3, qa_rows=1)
    parts = {(0, 3): (torch.tensor(4.0), 90), (3, None): (torch.tensor(8.0), 10)}
    loss, tokens = mixture.combine(lambda rows: parts[rows.start, rows.stop], corpus_rows=3)
    assert loss.item() == pytest.approx(0.75 * 4.0 + 0.25 * 8.0) and tokens == 100
    only = Mixture(qa_fraction=1.0, corpus_rows=0, qa_rows=4)
    assert only.combine(lambda rows: (torch.tensor(2.0), 7) if rows == slice(None) else None, 0)[0].item() == 2.0


def test_examples_are_split_as_lora_split_them_and_the_held_out_ones_are_never_drawn(
    qa_rows, qa_jsonl, tiny_shards_dir, tiny_tokenizer_dir
):
    train, heldout = split_examples(load_examples(str(qa_jsonl)), FRACTION)
    assert qa_rows.train_examples == train and qa_rows.heldout_examples == heldout
    assert {e.key for e in train}.isdisjoint({e.key for e in heldout})

    pad = load_tokenizer(tiny_tokenizer_dir).pad_token_id
    mixture = plan_mixture(0.5, 4, qa_rows)
    train_batch, _ = mixture_batches(TokenShards.open(tiny_shards_dir), TRAIN, mixture, qa_rows, pad)
    train_inputs = {tuple(ids[:-1]) for ids, _ in qa_rows.train}
    heldout_inputs = {tuple(ids[:-1]) for ids, _ in qa_rows.heldout}
    for step in range(50):
        batch = train_batch(step, 0)
        assert batch["input_ids"].shape == (4, 32) and batch["corpus_rows"] == 2
        for row, targets in zip(batch["input_ids"][2:].tolist(), batch["targets"][2:].tolist(), strict=True):
            length = max(i for i, t in enumerate(targets) if t != IGNORE_INDEX) + 1  # up to the answer's EOS
            drawn = tuple(row[:length])
            assert any(ids[:length] == drawn for ids in train_inputs)
            assert not any(ids[:length] == drawn for ids in heldout_inputs)


def test_prompt_tokens_are_masked_and_response_tokens_scored(qa_rows, tiny_shards_dir, tiny_tokenizer_dir):
    tok = load_tokenizer(tiny_tokenizer_dir)
    train_batch, _ = mixture_batches(
        TokenShards.open(tiny_shards_dir), TRAIN, plan_mixture(0.5, 4, qa_rows), qa_rows, tok.pad_token_id
    )
    batch = train_batch(0, 0)
    assert bool((batch["targets"][:2] != IGNORE_INDEX).all())  # corpus windows: every token scored
    for row, targets in zip(batch["input_ids"][2:], batch["targets"][2:], strict=True):
        scored = targets != IGNORE_INDEX
        first = int(scored.nonzero()[0])
        assert tok.decode(row[: first + 1]).endswith("Answer:")  # the prompt is context, never a target
        assert bool(scored[first:].sum() > 0)


def test_the_recorded_counts_are_what_the_batches_held(qa_rows, tiny_shards_dir, tiny_tokenizer_dir):
    pad = load_tokenizer(tiny_tokenizer_dir).pad_token_id
    mixture = plan_mixture(0.5, 4, qa_rows)
    train_batch, _ = mixture_batches(TokenShards.open(tiny_shards_dir), TRAIN, mixture, qa_rows, pad)
    response = sum(int((train_batch(step, 0)["targets"][2:] != IGNORE_INDEX).sum()) for step in range(TRAIN.max_steps))
    record = trained_on(mixture, qa_rows, TRAIN, world_size=1)
    assert record["response_tokens"] == response
    assert record["corpus_windows"] == TRAIN.max_steps * 2 and record["corpus_tokens"] == TRAIN.max_steps * 2 * 32
    assert record["example_rows"] == TRAIN.max_steps * 2


def test_distill_records_the_mixture_in_manifest_and_report(tmp_path, teacher, tiny_shards_dir, qa_jsonl):
    result = distill.run(DistillConfig(train=TRAIN), teacher=teacher, shards=tiny_shards_dir, student=tmp_path / "s")
    manifest = read_manifest(tmp_path / "s", verify=True)
    mixture = manifest["mixture"]
    assert mixture["qa_fraction"] == 0.5 and mixture["qa_uri"] == str(qa_jsonl)  # from the teacher's manifest
    assert (mixture["corpus_rows_per_batch"], mixture["example_rows_per_batch"]) == (2, 2)
    assert mixture["heldout_fraction"] == FRACTION and mixture["train_examples"] > mixture["heldout_examples"] > 0
    assert mixture["corpus_tokens"] == 6 * 2 * 32 and mixture["response_tokens"] > 0
    assert manifest["inputs"]["qa"]["heldout_fraction_source"] == "the LoRA stage's manifest"
    page = result.html.replace("<wbr>", "")  # the report's tables may break names at underscores
    assert "Training mixture" in page and "response_tokens" in page
    for name in ("student", "teacher"):
        assert result.metrics[f"{name}_heldout_answer_loss"] > 0


def test_corpus_only_distillation_still_measures_the_held_out_answer_loss(tmp_path, teacher, tiny_shards_dir):
    cfg = DistillConfig(qa_fraction=0.0, train=TRAIN)
    result = distill.run(cfg, teacher=teacher, shards=tiny_shards_dir, student=tmp_path / "s")
    mixture = read_manifest(tmp_path / "s")["mixture"]
    assert (mixture["qa_fraction"], mixture["example_rows"], mixture["reason"]) == (0.0, 0, None)
    assert result.metrics["student_heldout_answer_loss"] > 0


def test_a_teacher_without_recorded_q_and_a_distills_on_the_corpus_and_says_so(
    tmp_path, tiny_model_dir, tiny_shards_dir
):
    distill.run(DistillConfig(train=TRAIN), teacher=tiny_model_dir, shards=tiny_shards_dir, student=tmp_path / "s")
    mixture = read_manifest(tmp_path / "s")["mixture"]
    assert mixture["qa_fraction"] == 0.0 and mixture["requested_qa_fraction"] == 0.5
    assert mixture["reason"] == "no Q&A data given or recorded in the teacher's manifest"


def test_a_long_run_records_the_expected_example_counts_without_replaying_every_draw(qa_rows):
    long_run = TRAIN.model_copy(update={"max_steps": 200_000})
    record = trained_on(plan_mixture(0.5, 4, qa_rows), qa_rows, long_run, world_size=1)
    assert record["example_counts"] == "expected" and record["example_rows"] == 400_000
    mean_response = sum(sum(t != IGNORE_INDEX for t in labels[1:]) for _, labels in qa_rows.train) / len(qa_rows.train)
    assert record["response_tokens"] == pytest.approx(400_000 * mean_response, rel=1e-6)
