"""Base models from outside lmforge: what the pipeline can start from, and how it reads one.

A base model is a Hugging Face causal-LM directory (local or ``s3://``): ``config.json``, safetensors
weights and a fast tokenizer (``tokenizer.json`` with its config files), with or without an lmforge
``manifest.json``; a model written by plain ``transformers`` ``save_pretrained`` (and its tokenizer by
``tokenizer.save_pretrained``) is one. :func:`check_base_model` says whether the pipeline can handle it:
a GPT-2- or Llama-shaped model (:data:`SUPPORTED_ARCHITECTURES`, the two families lmforge builds, trains,
distills and exports), whose tokenizer has an end-of-sequence token and no more tokens than the model
has embedding rows.

Special tokens are the base's. Documents and examples end with its EOS. A tokenizer without a padding
token gets its EOS as the padding token (:func:`base_tokenizer`): padded positions are never scored
(labels ``-100``) and attention is causal with right padding, so the choice changes no loss, and it adds
no token, so the embedding matrix keeps its shape. A model trained from a base has its config's
``eos/bos/pad_token_id`` set from that tokenizer (:func:`align_special_tokens`), so that generation
stops where the tokenizer says (a plain ``GPT2Config`` names id 50256 whatever the vocabulary).
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lmforge import storage
from lmforge.artifacts import describe_files, input_record, read_json_file
from lmforge.errors import ArtifactIncompleteError, InputDataError, LmforgeError
from lmforge.model.build import check_model_dir, load_tokenizer
from lmforge.model.folder import (
    TOKENIZER_FILES,
    WEIGHT_FILES,
    WEIGHT_INDEX,
    WEIGHTS,
    custom_code_problem,
    index_problem,
)

SUPPORTED_ARCHITECTURES = ("gpt2", "llama")
"""``config.model_type`` values a base model may have."""
SPECIAL_TOKENS = ("eos_token", "bos_token", "unk_token", "pad_token")


def base_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The fast tokenizer in a model or tokenizer directory, with EOS as padding when it has no padding token.

    Raises:
        InputDataError: no ``tokenizer.json``, or no end-of-sequence token.
    """
    tokenizer = load_tokenizer(path)
    if tokenizer.eos_token_id is None:
        raise InputDataError(f"{path}: the tokenizer has no eos_token; documents and answers must end with one")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def architecture_problem(config: dict[str, Any]) -> str | None:
    """Why a ``config.json`` (as a mapping) is not a base the pipeline can handle, or ``None``."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        return (
            f"architecture {model_type!r} ({', '.join(config.get('architectures') or []) or 'no architectures'}) "
            f"is not supported; lmforge trains, distills and exports {' and '.join(SUPPORTED_ARCHITECTURES)} shapes"
        )
    architectures = config.get("architectures") or []
    if not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        return f"{architectures or 'no architectures'} is not a causal LM (expected *ForCausalLM or *LMHeadModel)"
    return None


def tokenizer_problem(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> str | None:
    """Why a base's tokenizer cannot drive a model with ``vocab_size`` embedding rows, or ``None``."""
    if not tokenizer.is_fast:
        return "the tokenizer is not a fast (tokenizer.json) tokenizer"
    if tokenizer.eos_token_id is None:
        return "the tokenizer has no eos_token (documents and answers must end with one)"
    if len(tokenizer) > vocab_size:
        return f"the tokenizer has {len(tokenizer)} tokens but the model only {vocab_size} embedding rows"
    return None


def fetch_metadata(uri: str | Path, workdir: str | Path) -> Path:
    """A local directory with a base model's ``config.json`` and tokenizer files (the directory itself when local).

    For ``s3://`` only those files (and ``model.safetensors.index.json``) are downloaded, never the weights.
    """
    if not storage.is_s3(str(uri)):
        if not Path(uri).is_dir():
            raise InputDataError(f"base model {uri}: not a directory")
        return Path(uri)
    for name in sorted(set(storage.list_files(str(uri))) & {"config.json", WEIGHT_INDEX, *TOKENIZER_FILES}):
        storage.download_file(storage.join(str(uri), name), storage.safe_join(workdir, name, where=str(uri)))
    return Path(workdir)


def check_base_model(uri: str) -> str:
    """``"ok"`` when the pipeline can start from the model at ``uri`` (local or ``s3://``), else the reason.

    Reads the file list, ``config.json`` and the tokenizer files only (the weights are not downloaded).
    Meant for preflight: every problem is returned, never raised.
    """
    try:
        names = set(storage.list_files(uri))
    except LmforgeError as exc:
        return str(exc)
    if "config.json" not in names:
        return f"{uri}: no config.json (expected a Hugging Face model directory)"
    if not names & set(WEIGHT_FILES):
        found = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt")))
        extra = f"; {', '.join(found)} are pickles, which lmforge never loads" if found else ""
        return f"{uri}: no safetensors weights ({' or '.join(WEIGHT_FILES)}){extra}"
    if "tokenizer.json" not in names:
        return f"{uri}: no tokenizer.json (the base's fast tokenizer is what tokenize and every stage use)"
    with tempfile.TemporaryDirectory(prefix="lmforge-base-check-") as workdir:
        try:
            local = fetch_metadata(uri, workdir)
            problem = base_problem(local)
            if not problem and WEIGHTS not in names:
                problem = index_problem(read_json_file(local / WEIGHT_INDEX), names)
        except LmforgeError as exc:
            return str(exc).replace(workdir, str(uri))
        except (OSError, ValueError) as exc:  # what a tokenizer file that transformers cannot parse raises
            return f"{uri}: the tokenizer cannot be loaded ({exc})"
    if problem:
        return f"{uri}: {problem}"
    return "ok"


def same_tokenizer(uri: str, other: str) -> str:
    """``"ok"`` when the models at ``uri`` and ``other`` (local or ``s3://``) have the same tokenizer, else how they
    differ (:func:`tokenizer_mismatch`). Only their tokenizer files are read; for preflight, so never raises."""
    with tempfile.TemporaryDirectory(prefix="lmforge-base-check-") as workdir:
        try:
            first = base_tokenizer(fetch_metadata(uri, Path(workdir, "a")))
            second = base_tokenizer(fetch_metadata(other, Path(workdir, "b")))
        except LmforgeError as exc:
            return str(exc)
        except (OSError, ValueError) as exc:
            return f"a tokenizer cannot be loaded ({exc})"
    if mismatch := tokenizer_mismatch(first, second):
        return (
            f"{other} does not share the tokenizer of {uri} ({mismatch}); the student learns from the teacher's "
            "logits, so both must have the same vocabulary and special tokens"
        )
    return "ok"


def base_problem(local: str | Path) -> str | None:
    """Why the base model whose config and tokenizer files are in ``local`` cannot be handled, or ``None``.

    Raises:
        InputDataError: ``config.json`` or ``tokenizer.json`` is missing or not valid JSON.
    """
    path = Path(local, "config.json")
    if not path.is_file():
        raise InputDataError(f"{local}: no config.json (expected a Hugging Face model directory)")
    config = read_json_file(path)
    if not isinstance(config, dict):
        return "config.json is not a JSON object"
    if problem := custom_code_problem("config.json", config) or architecture_problem(config):
        return problem
    tokenizer_config = Path(local, "tokenizer_config.json")
    tok_config = read_json_file(tokenizer_config) if tokenizer_config.is_file() else {}
    if isinstance(tok_config, dict) and (problem := custom_code_problem("tokenizer_config.json", tok_config)):
        return problem
    vocab_size = config.get("vocab_size")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
        return "config.json: vocab_size missing or not a positive integer"
    return tokenizer_problem(load_tokenizer(local), vocab_size)


def localize_model(uri: str | Path, workdir: str | Path) -> Path:
    """A local copy of a model directory (the path itself when local), checked by :func:`check_model_dir`.

    Errors name the URI the user gave, not the scratch copy.
    """
    local = storage.localize(str(uri), workdir)
    try:
        return check_model_dir(local)
    except InputDataError as exc:
        raise InputDataError(str(exc).replace(str(local), str(uri))) from exc


def refuse_unusable_base(local: Path, uri: str | Path, *, what: str = "base model") -> None:
    """Refuse the base model copied from ``uri`` to ``local`` when the pipeline cannot handle it (:func:`base_problem`).

    Raises:
        InputDataError: ``"<what> <uri>: <why>"``.
    """
    if problem := base_problem(local):
        raise InputDataError(f"{what} {uri}: {problem}")


def localize_base(uri: str | Path, workdir: str | Path, *, what: str = "base model") -> Path:
    """:func:`localize_model` for a base model, refused (:func:`refuse_unusable_base`) when it cannot be handled."""
    local = localize_model(uri, workdir)
    refuse_unusable_base(local, uri, what=what)
    return local


def model_record(local: Path, uri: str) -> dict[str, object]:
    """Lineage of a model input: its manifest's fingerprint, or (any HF directory) one over its files."""
    try:
        record = input_record(local)
    except ArtifactIncompleteError:
        files = describe_files(local)
        joined = "\n".join(f"{name}:{meta['sha256']}" for name, meta in sorted(files.items()))
        record = {"kind": "hf-model", "fingerprint": hashlib.sha256(joined.encode()).hexdigest()}
    return record | {"uri": str(uri)}


def tokenizer_mismatch(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> str | None:
    """How two tokenizers differ in what a model trained with one would notice (vocabulary, special tokens)."""
    vocab_a, vocab_b = a.get_vocab(), b.get_vocab()
    if vocab_a != vocab_b:
        differing = sorted(set(vocab_a.items()) ^ set(vocab_b.items()), key=lambda item: item[1])[:3]
        return f"vocabularies differ ({len(vocab_a)} vs {len(vocab_b)} tokens; e.g. {differing})"
    for name in SPECIAL_TOKENS:
        if getattr(a, name) != getattr(b, name):
            return f"{name} differs ({getattr(a, name)!r} vs {getattr(b, name)!r})"
    return None


def align_special_tokens(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Set the model's (and its generation config's) EOS, BOS and padding ids from ``tokenizer``."""
    ids = {
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    }
    for config in (model.config, getattr(model, "generation_config", None)):
        if config is not None:
            for key, value in ids.items():
                setattr(config, key, value)
