"""Base models as a user brings them: written by plain ``transformers`` ``save_pretrained``, with a tokenizer that
is not lmforge's (trained here with ``tokenizers``: another vocabulary size, other special tokens, no padding token).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

GPT2_VOCAB = 700  # tokenizer size; the model has a few spare embedding rows, as padded vocabularies do
LLAMA_VOCAB = 600


def gpt2_tokenizer(texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE with ``<s>``, ``</s>``, ``<unk>`` (ids 0-2) and no padding token."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=GPT2_VOCAB,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", model_max_length=128
    )


def llama_tokenizer(texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """A SentencePiece-style (Metaspace) BPE that prepends ``<s>`` like Llama's, ``<unk>``/``<s>``/``</s>`` = 0-2."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=LLAMA_VOCAB, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", model_max_length=128
    )


def gpt2_base(out: Path, texts: list[str]) -> Path:
    """A 2-layer GPT-2 (``gelu_new``, the config's default special ids 50256) and its own tokenizer."""
    tokenizer = gpt2_tokenizer(texts)
    config = GPT2Config(vocab_size=GPT2_VOCAB + 4, n_positions=128, n_embd=32, n_layer=2, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def llama_base(out: Path, texts: list[str]) -> Path:
    """A 2-layer Llama with grouped-query attention and untied embeddings, and its own tokenizer."""
    tokenizer = llama_tokenizer(texts)
    config = LlamaConfig(
        vocab_size=LLAMA_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
