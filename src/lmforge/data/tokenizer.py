"""Byte-level BPE tokenizers in Hugging Face format."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from lmforge.artifacts import sha256_file

TOKENIZER_FILE = "tokenizer.json"


def train_bpe_tokenizer(
    texts: Iterable[str], *, vocab_size: int, min_frequency: int, eos_token: str, pad_token: str
) -> PreTrainedTokenizerFast:
    """Train a GPT-2-style byte-level BPE on ``texts`` (EOS and PAD are special tokens 0 and 1)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[eos_token, pad_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=eos_token,
        eos_token=eos_token,
        unk_token=eos_token,
        pad_token=pad_token,
        model_max_length=1_000_000,
    )


def tokenizer_fingerprint(directory: str | Path) -> str:
    """sha256 of a saved tokenizer's ``tokenizer.json``: equal fingerprints encode identically."""
    return sha256_file(Path(directory, TOKENIZER_FILE))
