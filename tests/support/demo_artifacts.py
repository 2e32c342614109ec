"""Small real artifacts made from the packaged demo text without the pipeline's stages: a BPE tokenizer, token
shards (every 10th document in ``val``) and a randomly initialized model, each with its manifest.

The shared fixtures (tests/conftest.py) and the benchmarks (bench/) build their inputs with these.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from lmforge.artifacts import write_manifest
from lmforge.config import ModelConfig
from lmforge.data.tokenizer import tokenizer_fingerprint, train_bpe_tokenizer
from lmforge.formats.token_shards import ShardWriter
from lmforge.model.build import build_model, load_tokenizer, save_model_dir


def write_tokenizer(texts: Iterable[str], out: Path, vocab_size: int) -> Path:
    """A byte-level BPE of ``vocab_size`` (merges seen twice or more, lmforge's EOS and padding tokens) trained on
    ``texts``, saved in HF layout in ``out``."""
    tok = train_bpe_tokenizer(
        texts, vocab_size=vocab_size, min_frequency=2, eos_token="<|endoftext|>", pad_token="<|pad|>"
    )
    tok.save_pretrained(out)
    write_manifest(out, "tokenizer")
    return out


def write_shards(texts: Iterable[str], tokenizer_dir: Path, out: Path, shard_tokens: int) -> int:
    """Token shards of ``texts`` in ``out``, each text ended by EOS, every 10th in ``val``; the tokens written."""
    tok = load_tokenizer(tokenizer_dir)
    writer = ShardWriter(
        out,
        vocab_size=len(tok),
        eos_id=tok.eos_token_id,
        tokenizer_sha256=tokenizer_fingerprint(tokenizer_dir),
        shard_tokens=shard_tokens,
    )
    tokens = 0
    for i, text in enumerate(texts):
        ids = tok(text)["input_ids"] + [tok.eos_token_id]
        tokens += len(ids)
        writer.add_document("val" if i % 10 == 0 else "train", np.array(ids))
    writer.close()
    write_manifest(out, "token-shards")
    return tokens


def write_random_model(shape: ModelConfig, tokenizer_dir: Path, out: Path, vocab_size: int | None = None) -> Path:
    """A model of ``shape`` with random weights (seed 0) and the tokenizer of ``tokenizer_dir``, in HF layout in
    ``out``; its vocabulary is ``vocab_size`` rows, by default the tokenizer's size."""
    tok = load_tokenizer(tokenizer_dir)
    model = build_model(shape, vocab_size or len(tok), eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, seed=0)
    save_model_dir(model, tok, out)
    write_manifest(out, "model")
    return out
