"""Byte-level BPE tokenizers in Hugging Face format."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from lmforge.artifacts import sha256_file

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# transformers 5 names a tokenizer.json-backed tokenizer by a class transformers 4.x lacks; PreTrainedTokenizerFast is
# the class of the same tokenizer in 4.x, and an alias of it in 5.x, so both load what names it.
_ONLY_IN_TRANSFORMERS_5 = "TokenizersBackend"
PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
# What a causal LM takes: without it transformers 4.x's PreTrainedTokenizerFast also returns token_type_ids, which
# generate() (of transformers or optimum's ORTModelForCausalLM) refuses.
MODEL_INPUT_NAMES = ("input_ids", "attention_mask")


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
        model_input_names=list(MODEL_INPUT_NAMES),
        bos_token=eos_token,
        eos_token=eos_token,
        unk_token=eos_token,
        pad_token=pad_token,
        model_max_length=1_000_000,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, directory: str | Path) -> None:
    """``save_pretrained`` ``tokenizer`` into ``directory`` so that transformers 4.x and 5.x both load it.

    A class only transformers 5 knows in ``tokenizer_config.json`` is replaced by :data:`PORTABLE_TOKENIZER_CLASS`;
    a model-specific class (``GPT2TokenizerFast``, a base model's) is left as it is.
    """
    tokenizer.save_pretrained(directory)
    path = Path(directory, TOKENIZER_CONFIG_FILE)
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") == _ONLY_IN_TRANSFORMERS_5:
        config["tokenizer_class"] = PORTABLE_TOKENIZER_CLASS
        path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def tokenizer_fingerprint(directory: str | Path) -> str:
    """sha256 of a saved tokenizer's ``tokenizer.json``: equal fingerprints encode identically."""
    return sha256_file(Path(directory, TOKENIZER_FILE))
