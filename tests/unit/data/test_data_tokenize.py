"""The ``tokenize`` stage: tokenizer training, the train/val split and packed token shards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from lmforge.artifacts import read_manifest, sha256_file
from lmforge.config import CleanConfig, TokenizeConfig
from lmforge.contracts import split_bucket
from lmforge.data import clean, tokenize
from lmforge.data.tokenize import SplitPlan
from lmforge.data.tokenizer import tokenizer_fingerprint
from lmforge.errors import InputDataError
from lmforge.formats.cleaned import read_cleaned
from lmforge.formats.token_shards import TokenShards
from lmforge.model.build import load_tokenizer

CFG = TokenizeConfig(vocab_size=512, val_fraction=0.1, shard_tokens=40_000)


def make_cleaned(root: Path, records: list[dict[str, str]]) -> Path:
    corpus = root / "corpus.jsonl"
    corpus.parent.mkdir(parents=True, exist_ok=True)
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    rules_off = {
        name: {"enabled": False} for name in ("language", "gopher_repetition", "gopher_quality", "c4", "fineweb")
    }
    clean.run(
        CleanConfig.model_validate({"min_chars": 0, "min_words": 0, **rules_off}),
        corpus_uri=str(corpus),
        cleaned=root / "cleaned",
    )
    return root / "cleaned"


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory, shakespeare_docs):
    root = tmp_path_factory.mktemp("tokenize")
    cleaned = make_cleaned(root, shakespeare_docs)
    result = tokenize.run(CFG, cleaned=cleaned, tokenizer=root / "tokenizer", shards=root / "shards")
    return result, cleaned, root / "tokenizer", root / "shards"


def test_shard_token_counts_equal_the_encoded_documents_plus_eos(tokenized):
    result, cleaned, tok_dir, shards_dir = tokenized
    tok = load_tokenizer(tok_dir)
    expected: dict[str, list[int]] = {"train": [], "val": []}
    for row in read_cleaned(cleaned):
        split = "val" if split_bucket(row["id"]) < result.metrics["val_threshold"] else "train"
        expected[split] += tok(row["text"])["input_ids"] + [tok.eos_token_id]

    shards = TokenShards.open(shards_dir)
    assert shards.dtype == np.uint16 and shards.eos_id == tok.eos_token_id == 0
    for split in ("train", "val"):
        assert np.array_equal(shards.tokens(split), np.array(expected[split], dtype=np.uint16))
    m = result.metrics
    assert (m["train_tokens"], m["val_tokens"]) == (len(expected["train"]), len(expected["val"]))
    assert m["documents"] == m["train_documents"] + m["val_documents"] == 60
    assert m["val_documents"] > 0 and m["vocab_size"] == len(tok) == 512
    assert m["tokens_per_sec"] > 0
    assert m["shards"] == len(shards.index["shards"]) > 2  # shard_tokens forces roll-over


def test_index_and_manifests_record_hashes_and_lineage(tokenized):
    _, cleaned, tok_dir, shards_dir = tokenized
    index = json.loads((shards_dir / "index.json").read_text())
    for shard in index["shards"]:
        assert sha256_file(shards_dir / shard["name"]) == shard["sha256"]
    fingerprint = tokenizer_fingerprint(tok_dir)
    assert index["tokenizer_sha256"] == fingerprint

    shards_manifest = read_manifest(shards_dir, verify=True)
    assert shards_manifest["kind"] == "token-shards"
    assert shards_manifest["tokenizer_sha256"] == fingerprint
    assert shards_manifest["inputs"]["cleaned"]["uri"] == str(cleaned)
    assert shards_manifest["inputs"]["cleaned"]["kind"] == "cleaned-corpus"
    tok_manifest = read_manifest(tok_dir, verify=True)
    assert tok_manifest["kind"] == "tokenizer" and tok_manifest["tokenizer_sha256"] == fingerprint


def test_tokenizer_round_trips_ascii_text(tokenized):
    tok = load_tokenizer(tokenized[2])
    text = "To be, or not to be: that is the question.\n  Whether 'tis nobler (42%) ~ {x}"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_a_tampered_shard_byte_is_detected(tokenized, tmp_path):
    copy = tmp_path / "shards"
    shutil.copytree(tokenized[3], copy)
    shard = copy / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(InputDataError, match="train-00000.bin: sha256 mismatch"):
        TokenShards.open(copy)


@pytest.mark.parametrize("fraction", [1e-12, 1 - 1e-12], ids=["all-train", "all-val"])
def test_split_plan_keeps_one_document_on_each_side(fraction):
    ids = [f"doc-{i}" for i in range(5)]
    plan = SplitPlan(TokenizeConfig(val_fraction=fraction, min_val_tokens=0, min_val_documents=0))
    for position, doc_id in enumerate(ids):
        plan.observe(position, doc_id)
    splits = [plan.split(position, doc_id) for position, doc_id in enumerate(ids)]
    assert splits.count("val") == (1 if fraction < 0.5 else 4)
    assert splits == [plan.split(p, d) for p, d in enumerate(ids)]  # deterministic


def test_the_val_split_grows_in_hash_order_to_the_minimum_tokens_and_documents(tmp_path_factory, shakespeare_docs):
    root = tmp_path_factory.mktemp("widened")
    cleaned = make_cleaned(root, shakespeare_docs)
    cfg = TokenizeConfig(vocab_size=512, val_fraction=0.05, min_val_tokens=20_000, min_val_documents=8)
    result = tokenize.run(cfg, cleaned=cleaned, tokenizer=root / "tok", shards=root / "shards")
    m = result.metrics
    buckets = sorted(split_bucket(row["id"]) for row in read_cleaned(cleaned))
    assert sum(b < 0.05 for b in buckets) < 8  # val_fraction alone holds too few documents
    assert m["val_documents"] >= 8 and m["val_tokens"] >= 20_000
    assert m["val_documents"] == sum(b < m["val_threshold"] for b in buckets) <= 0.25 * 60 + 1
    # the smallest such split: without its last document it would fall short
    tok = load_tokenizer(root / "tok")
    val_rows = [row for row in read_cleaned(cleaned) if split_bucket(row["id"]) < m["val_threshold"]]
    last = max(val_rows, key=lambda row: split_bucket(row["id"]))
    shorter = m["val_tokens"] - len(tok(last["text"])["input_ids"]) - 1
    assert shorter < 20_000 or m["val_documents"] - 1 < 8


@pytest.mark.parametrize(
    ("tokens", "documents", "warning"),
    [
        (0, 0, "only 3 document: the val split is empty"),
        (
            900,
            2,
            "the val split holds 900 tokens in 2 documents, below min_val_tokens 1000 / min_val_documents 2 even at "
            "max_val_fraction 0.3: evaluation marks its held-out figures low confidence",
        ),
        (1000, 1, "the val split holds 1000 tokens in 1 documents, below min_val_tokens 1000 / min_val_documents 2"),
        (1000, 2, None),
    ],
    ids=["empty", "few-tokens", "few-documents", "enough"],
)
def test_a_val_split_below_its_minimums_is_warned_of(caplog, tokens, documents, warning):
    cfg = TokenizeConfig(min_val_tokens=1000, min_val_documents=2, max_val_fraction=0.3)
    plan = SplitPlan(cfg)
    for position in range(3):
        plan.observe(position, f"doc-{position}")
    with caplog.at_level("WARNING", logger="lmforge.tokenize"):
        tokenize._warn_of_a_small_val_split({"tokens": tokens, "documents": documents}, plan, cfg)
    messages = [record.getMessage() for record in caplog.records]
    if warning is None:
        assert messages == []
    else:
        assert len(messages) == 1 and messages[0].startswith(warning)


def test_two_documents_always_give_a_train_and_a_val_document(tmp_path):
    cleaned = make_cleaned(tmp_path, [{"text": "first document text"}, {"text": "second document text"}])
    cfg = TokenizeConfig(vocab_size=300, val_fraction=1e-9)
    result = tokenize.run(cfg, cleaned=cleaned, tokenizer=tmp_path / "tok", shards=tmp_path / "shards")
    assert (result.metrics["train_documents"], result.metrics["val_documents"]) == (1, 1)


def test_nonempty_output_fails_before_work_and_leaves_nothing(tmp_path):
    cleaned = make_cleaned(tmp_path, [{"text": "some document text"}])
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "old.bin").write_bytes(b"x")
    with pytest.raises(InputDataError, match="already exists and is not empty"):
        tokenize.run(CFG, cleaned=cleaned, tokenizer=tmp_path / "tok", shards=tmp_path / "shards")
    assert not (tmp_path / "tok").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cleaned", "corpus.jsonl", "shards"]


def test_a_directory_that_is_not_a_cleaned_corpus_is_refused(tmp_path, tokenized):
    with pytest.raises(InputDataError, match="expected 'cleaned-corpus'"):
        tokenize.run(CFG, cleaned=tokenized[3], tokenizer=tmp_path / "tok", shards=tmp_path / "shards")
    assert list(tmp_path.iterdir()) == []
