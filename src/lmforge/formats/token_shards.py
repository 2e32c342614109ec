"""Token shards: the contract between ``tokenize`` and every stage that reads tokens.

A shards directory holds ``train-NNNNN.bin`` / ``val-NNNNN.bin`` (flat little-endian token ids,
documents joined by EOS; ``uint16`` when the vocabulary fits, else ``uint32``) and ``index.json``::

    {"format": "lmforge-token-shards/1", "dtype": "uint16", "vocab_size": 2048, "eos_id": 0,
     "tokenizer_sha256": "...",
     "splits": {"train": {"tokens": 123, "documents": 7}, "val": {...}},
     "shards": [{"name": "train-00000.bin", "split": "train", "tokens": 123, "sha256": "..."}]}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.artifacts import read_json_file, sha256_file
from lmforge.errors import InputDataError

INDEX = "index.json"
FORMAT = "lmforge-token-shards/1"
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits in 16 bits, else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def shard_name(split: str, number: int) -> str:
    """File name of shard ``number`` of ``split``."""
    return f"{split}-{number:05d}.bin"


@dataclass(frozen=True)
class TokenShards:
    """Read access to a shards directory written by the ``tokenize`` stage."""

    root: Path
    index: dict[str, Any]

    @classmethod
    def open(cls, root: str | Path, *, verify: bool = True) -> TokenShards:
        """Load ``index.json``; with ``verify`` check each shard's size and sha256."""
        root = Path(root)
        path = root / INDEX
        if not path.is_file():
            raise InputDataError(f"{root}: no {INDEX}; not a token shards directory")
        index = read_json_file(path)
        if index.get("format") != FORMAT:
            raise InputDataError(f"{path}: format {index.get('format')!r}, expected {FORMAT!r}")
        shards = cls(root, index)
        for shard in index["shards"]:
            file = root / shard["name"]
            if not file.is_file():
                raise InputDataError(f"token shard {file} listed in {INDEX} is missing")
            expected_bytes = shard["tokens"] * shards.dtype.itemsize
            if file.stat().st_size != expected_bytes:
                raise InputDataError(f"token shard {file}: {file.stat().st_size} bytes, expected {expected_bytes}")
            if verify and (actual := sha256_file(file)) != shard["sha256"]:
                raise InputDataError(f"token shard {file}: sha256 mismatch, expected {shard['sha256']}, got {actual}")
        return shards

    @property
    def dtype(self) -> np.dtype:
        """Token id dtype of every shard."""
        return np.dtype(self.index["dtype"])

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the tokenizer that wrote the shards."""
        return int(self.index["vocab_size"])

    @property
    def eos_id(self) -> int:
        """End-of-document token id."""
        return int(self.index["eos_id"])

    @property
    def tokenizer_sha256(self) -> str:
        """Fingerprint of the tokenizer that wrote the shards."""
        return str(self.index["tokenizer_sha256"])

    def arrays(self, split: str) -> list[np.memmap]:
        """Memory-mapped shards of ``split`` in order."""
        if split not in SPLITS:
            raise InputDataError(f"unknown split {split!r}; expected one of {SPLITS}")
        return [
            np.memmap(self.root / s["name"], dtype=self.dtype, mode="r")
            for s in self.index["shards"]
            if s["split"] == split and s["tokens"] > 0
        ]

    def tokens(self, split: str) -> np.ndarray:
        """All tokens of ``split`` as one array (a memmap when there is a single shard)."""
        parts = self.arrays(split)
        if not parts:
            raise InputDataError(f"{self.root}: split {split!r} has no tokens")
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


class ShardWriter:
    """Append token ids per split; rolls over to a new shard file every ``shard_tokens`` tokens.

    Files are written inside ``root`` (the caller's staging directory); :meth:`close` writes
    ``index.json`` with per-shard sha256 and returns the index.
    """

    def __init__(
        self, root: str | Path, *, vocab_size: int, eos_id: int, tokenizer_sha256: str, shard_tokens: int
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.dtype = token_dtype(vocab_size)
        self.meta = {"vocab_size": vocab_size, "eos_id": eos_id, "tokenizer_sha256": tokenizer_sha256}
        self.shard_tokens = shard_tokens
        self._open: dict[str, tuple[Any, dict[str, Any]]] = {}
        self._shards: list[dict[str, Any]] = []
        self._counts = {s: {"tokens": 0, "documents": 0} for s in SPLITS}

    def _roll(self, split: str) -> tuple[Any, dict[str, Any]]:
        if split in self._open:
            fh, record = self._open.pop(split)
            fh.close()
        number = sum(1 for s in self._shards if s["split"] == split)
        record = {"name": shard_name(split, number), "split": split, "tokens": 0}
        self._shards.append(record)
        fh = open(self.root / record["name"], "wb")  # noqa: SIM115 - closed in _roll/close
        self._open[split] = (fh, record)
        return fh, record

    def add_document(self, split: str, ids: np.ndarray | list[int]) -> None:
        """Append one document's ids (the caller appends EOS) to ``split``."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}")
        array = np.asarray(ids, dtype=np.int64)
        if array.size and (array.min() < 0 or array.max() >= self.meta["vocab_size"]):
            raise ValueError(f"token id out of range for vocab_size {self.meta['vocab_size']}")
        array = array.astype(self.dtype)
        fh, record = self._open.get(split) or self._roll(split)
        while array.size:
            room = self.shard_tokens - record["tokens"]
            if room == 0:
                fh, record = self._roll(split)
                continue
            chunk, array = array[:room], array[room:]
            fh.write(chunk.tobytes())
            record["tokens"] += int(chunk.size)
            self._counts[split]["tokens"] += int(chunk.size)
        self._counts[split]["documents"] += 1

    def close(self) -> dict[str, Any]:
        """Close open shards, write ``index.json`` and return the index."""
        for fh, _ in self._open.values():
            fh.close()
        self._open.clear()
        for record in self._shards:
            record["sha256"] = sha256_file(self.root / record["name"])
        index = {
            "format": FORMAT,
            "dtype": self.dtype.name,
            **self.meta,
            "splits": self._counts,
            "shards": self._shards,
        }
        (self.root / INDEX).write_text(json.dumps(index, indent=2), encoding="utf-8")
        return index
