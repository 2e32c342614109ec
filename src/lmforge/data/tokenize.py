"""The ``tokenize`` stage: train a byte-level BPE on cleaned documents (or take a base model's tokenizer) and
pack the documents into token shards.

Two streaming passes over the cleaned corpus: the first trains the tokenizer and plans the split, the
second encodes documents in batches, appends EOS to each and writes ``train``/``val`` shards. A document
goes to ``val`` when the hash of its id falls below ``val_fraction``; with two or more documents each
split is guaranteed at least one (see :class:`SplitPlan`).

With a base model (:mod:`lmforge.model.base`) nothing is trained: the base's tokenizer becomes the
tokenizer artifact, its vocabulary size decides the shard dtype (``uint32`` above 65,536 tokens) and its
EOS ends every document; ``vocab_size``, ``min_frequency``, ``eos_token`` and ``pad_token`` of the config
do not apply. Documents are encoded without the tokenizer's own special tokens (no BOS per document):
the shards are documents joined by EOS, whatever the tokenizer.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import time
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lmforge import report_html
from lmforge.artifacts import input_record, sha256_file, staged_output, write_manifest
from lmforge.config import TokenizeConfig
from lmforge.data.cleaned import read_cleaned
from lmforge.data.shards import INDEX, ShardWriter, token_dtype
from lmforge.data.tokenizer import save_tokenizer, tokenizer_fingerprint, train_bpe_tokenizer
from lmforge.errors import InputDataError
from lmforge.model.base import TOKENIZER_FILES, base_problem, base_tokenizer, fetch_metadata
from lmforge.results import StageResult

log = logging.getLogger("lmforge.tokenize")

TOKENIZER_KIND = "tokenizer"
SHARDS_KIND = "token-shards"
ENCODE_BATCH_DOCS = 256


def split_bucket(doc_id: str) -> float:
    """A document's position in [0, 1), uniform over ids and stable across runs and machines."""
    return int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big") / 2**64


class SplitPlan:
    """Assign documents (identified by stream position and id) to ``train`` or ``val``.

    :meth:`observe` every document once, in stream order, then call :meth:`split` for each. When the
    hash split leaves ``val`` empty, the document with the smallest bucket moves to ``val``; when it
    leaves ``train`` empty, the one with the largest bucket moves to ``train``. Memory is constant.
    """

    def __init__(self, val_fraction: float) -> None:
        self.val_fraction = val_fraction
        self.documents = 0
        self.val = 0
        self._lowest = (2.0, -1)  # (bucket, position) of the document most likely to be val
        self._highest = (-1.0, -1)

    def observe(self, position: int, doc_id: str) -> None:
        bucket = split_bucket(doc_id)
        self.documents += 1
        self.val += bucket < self.val_fraction
        self._lowest = min(self._lowest, (bucket, position))
        self._highest = max(self._highest, (bucket, position))

    def split(self, position: int, doc_id: str) -> str:
        if self.documents >= 2:
            if self.val == 0 and position == self._lowest[1]:
                return "val"
            if self.val == self.documents and position == self._highest[1]:
                return "train"
        return "val" if split_bucket(doc_id) < self.val_fraction else "train"


def _base_record(uri: str, local: Path) -> dict[str, object]:
    """Lineage of a base model's tokenizer: the URI and the sha256 of each tokenizer file."""
    files = {name: sha256_file(local / name) for name in TOKENIZER_FILES if (local / name).is_file()}
    return {"uri": uri, "kind": "base-model-tokenizer", "files": files}


def run(
    cfg: TokenizeConfig,
    *,
    cleaned: str | Path,
    tokenizer: str | Path,
    shards: str | Path,
    base_model: str | Path | None = None,
) -> StageResult:
    """Write a tokenizer to ``tokenizer`` and token shards of the ``cleaned`` corpus to ``shards``.

    The tokenizer is a byte-level BPE trained on the corpus, or, given ``base_model`` (a Hugging Face model
    directory, local or ``s3://``; only its config and tokenizer files are read), the base's tokenizer.
    Both outputs are committed together at the end; on any error neither is left behind.

    Raises:
        InputDataError: the corpus has no documents, or the base model's architecture or tokenizer cannot
            be handled (:func:`lmforge.model.base.check_base_model` says why).
    """
    base_model = base_model or None  # an unset pipeline parameter arrives as ""
    cleaned_record = input_record(cleaned)
    plan = SplitPlan(cfg.val_fraction)

    def training_texts() -> Iterator[str]:
        for position, row in enumerate(read_cleaned(cleaned, verify=True)):
            plan.observe(position, row["id"])
            yield row["text"]

    with (
        tempfile.TemporaryDirectory(prefix="lmforge-tokenize-") as workdir,
        staged_output(tokenizer) as tok_stage,
        staged_output(shards) as shard_stage,
    ):
        start = time.perf_counter()
        inputs: dict[str, object] = {"cleaned": cleaned_record}
        if base_model is None:
            bpe = train_bpe_tokenizer(
                training_texts(),
                vocab_size=cfg.vocab_size,
                min_frequency=cfg.min_frequency,
                eos_token=cfg.eos_token,
                pad_token=cfg.pad_token,
            )
            source = "trained"
        else:
            local = fetch_metadata(base_model, workdir)
            if problem := base_problem(local):
                raise InputDataError(f"base model {base_model}: {problem}")
            bpe = base_tokenizer(local)
            for _ in training_texts():  # the split plan still needs one pass
                pass
            inputs["base_model"] = _base_record(str(base_model), local)
            source = "base_model"
        if plan.documents == 0:
            raise InputDataError(f"{cleaned}: the cleaned corpus has no documents")
        save_tokenizer(bpe, tok_stage)
        fingerprint = tokenizer_fingerprint(tok_stage)
        vocab_size = len(bpe)
        eos_id = bpe.eos_token_id
        log.info(
            "%s a %d-token tokenizer (EOS %r, padding %r, %s shards) on %d documents in %.1fs",
            "trained" if base_model is None else f"took the base model's ({base_model})",
            vocab_size,
            bpe.eos_token,
            bpe.pad_token,
            token_dtype(vocab_size).name,
            plan.documents,
            time.perf_counter() - start,
        )
        write_manifest(
            tok_stage,
            TOKENIZER_KIND,
            inputs=inputs,
            config=cfg.model_dump(),
            metrics={"vocab_size": vocab_size},
            extra={
                "tokenizer_sha256": fingerprint,
                "source": source,
                "special_tokens": {"eos": bpe.eos_token, "pad": bpe.pad_token, "bos": bpe.bos_token},
            },
        )

        start = time.perf_counter()
        writer = ShardWriter(
            shard_stage,
            vocab_size=vocab_size,
            eos_id=eos_id,
            tokenizer_sha256=fingerprint,
            shard_tokens=cfg.shard_tokens,
        )
        rows = enumerate(read_cleaned(cleaned, verify=False))
        with tqdm(total=plan.documents, desc="tokenize", unit="doc", disable=None) as progress:
            while batch := list(islice(rows, ENCODE_BATCH_DOCS)):
                texts = [row["text"] for _, row in batch]
                doc_splits = [plan.split(position, row["id"]) for position, row in batch]
                encoded = bpe(texts, add_special_tokens=False)["input_ids"]
                for split, ids in zip(doc_splits, encoded, strict=True):
                    ids.append(eos_id)
                    writer.add_document(split, np.asarray(ids, dtype=np.int64))
                progress.update(len(batch))
        index = writer.close()
        elapsed = time.perf_counter() - start

        splits = index["splits"]
        if splits["val"]["documents"] == 0:
            log.warning("only %d document: the val split is empty", plan.documents)
        total_tokens = splits["train"]["tokens"] + splits["val"]["tokens"]
        metrics: dict[str, float] = {
            "vocab_size": vocab_size,
            "documents": plan.documents,
            "train_documents": splits["train"]["documents"],
            "val_documents": splits["val"]["documents"],
            "train_tokens": splits["train"]["tokens"],
            "val_tokens": splits["val"]["tokens"],
            "shards": len(index["shards"]),
            "tokens_per_sec": total_tokens / max(elapsed, 1e-9),
        }
        write_manifest(
            shard_stage,
            SHARDS_KIND,
            inputs=inputs,
            config=cfg.model_dump(),
            metrics=metrics,
            extra={"tokenizer_sha256": fingerprint, "index": INDEX, "source": source},
        )

    log.info(
        "tokenized %d documents: %d train / %d val tokens in %d shards, %.0f tokens/s",
        plan.documents,
        metrics["train_tokens"],
        metrics["val_tokens"],
        metrics["shards"],
        metrics["tokens_per_sec"],
    )
    html = report_html.page(
        "lmforge tokenize",
        [("Metrics", report_html.table(["metric", "value"], list(metrics.items())))],
        subtitle=f"input: {cleaned}",
    )
    summary = {
        "tokenizer_dir": str(tokenizer),
        "shards_dir": str(shards),
        "tokenizer_sha256": fingerprint,
        "shards": [s["name"] for s in index["shards"]],
    }
    return StageResult(metrics=metrics, html=html, summary=summary)
