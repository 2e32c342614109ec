"""Question/answer data for fine-tuning and generation checks.

Input is JSONL with ``prompt``/``response`` strings per line (or a ``demo://`` corpus). The split into
train and held-out pairs is by a hash of the prompt, so every stage (``finetune_lora``, ``evaluate``)
that calls :func:`split_pairs` with the same fraction gets the same held-out set, and all answers to
one question fall on the same side.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lmforge import storage
from lmforge.data.demo import is_demo, materialize
from lmforge.errors import InputDataError

PROMPT_TEMPLATE = "Question: {prompt}\nAnswer:"


@dataclass(frozen=True)
class QAPair:
    """One prompt and its reference response."""

    prompt: str
    response: str

    def prompt_text(self) -> str:
        """The prompt as the model sees it (the documented default template)."""
        return PROMPT_TEMPLATE.format(prompt=self.prompt)

    def response_text(self, eos_token: str) -> str:
        """The target continuation: a leading space, the response, then EOS."""
        return f" {self.response}{eos_token}"


def load_pairs(uri: str) -> list[QAPair]:
    """Read all pairs from a JSONL file (local, ``s3://`` or ``demo://``); errors name file and line."""
    with tempfile.TemporaryDirectory(prefix="lmforge-qa-") as workdir:
        path = materialize(uri, workdir) if is_demo(uri) else storage.localize(uri, workdir)
        if path.is_dir():
            raise InputDataError(f"Q&A data {uri}: expected a JSONL file, got a directory")
        pairs = list(_parse_jsonl(path, uri))
    if not pairs:
        raise InputDataError(f"Q&A data {uri}: no prompt/response pairs")
    return pairs


def _parse_jsonl(path: Path, name: str):
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputDataError(f"{name}:{lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(record, dict):
                raise InputDataError(f"{name}:{lineno}: expected a JSON object")
            for field in ("prompt", "response"):
                if not isinstance(record.get(field), str) or not record[field].strip():
                    raise InputDataError(f"{name}:{lineno}: field {field!r} missing or not a non-empty string")
            yield QAPair(record["prompt"].strip(), record["response"].strip())


def is_heldout(prompt: str, fraction: float) -> bool:
    """Deterministic membership of a prompt in the held-out split."""
    bucket = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") / 2**64
    return bucket < fraction


def split_pairs(pairs: list[QAPair], heldout_fraction: float) -> tuple[list[QAPair], list[QAPair]]:
    """``(train, heldout)`` by prompt hash; raises if either side ends up empty."""
    train = [p for p in pairs if not is_heldout(p.prompt, heldout_fraction)]
    heldout = [p for p in pairs if is_heldout(p.prompt, heldout_fraction)]
    if not train or not heldout:
        raise InputDataError(
            f"Q&A split with heldout_fraction={heldout_fraction} leaves {len(train)} train and "
            f"{len(heldout)} held-out pairs; need at least one of each"
        )
    return train, heldout
