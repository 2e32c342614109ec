"""The ``tokenize`` stage: train a byte-level BPE on cleaned documents (or take a base model's tokenizer) and
pack the documents into token shards.

Two streaming passes over the cleaned corpus: the first trains the tokenizer and plans the split, the
second encodes documents in batches, appends EOS to each and writes ``train``/``val`` shards. A document
goes to ``val`` when the hash of its id falls below a threshold: ``val_fraction``, raised (up to
``max_val_fraction``) until the split holds ``min_val_tokens`` tokens and ``min_val_documents`` documents. When
the first pass cannot rule out a shortfall, a counting pass encodes the documents below ``max_val_fraction``
to set the threshold by exact token counts (small corpora only: a large one's ``val_fraction`` holds enough).
With two or more documents each split is guaranteed at least one (see :class:`SplitPlan`).

With a base model (:mod:`lmforge.model.base`) nothing is trained: the base's tokenizer becomes the
tokenizer artifact, its vocabulary size decides the shard dtype (``uint32`` above 65,536 tokens) and its
EOS ends every document; ``vocab_size``, ``min_frequency``, ``eos_token`` and ``pad_token`` of the config
do not apply. Documents are encoded without the tokenizer's own special tokens (no BOS per document):
the shards are documents joined by EOS, whatever the tokenizer.
"""

from __future__ import annotations

import bisect
import logging
import tempfile
import time
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from lmforge import report_html
from lmforge.artifacts import input_record, sha256_file, staged_output, write_manifest
from lmforge.config import TokenizeConfig
from lmforge.contracts import split_bucket
from lmforge.data.tokenizer import save_tokenizer, tokenizer_fingerprint, train_bpe_tokenizer
from lmforge.errors import InputDataError
from lmforge.formats.cleaned import read_cleaned
from lmforge.formats.token_shards import INDEX, ShardWriter, token_dtype
from lmforge.model.folder import TOKENIZER_FILES
from lmforge.results import StageResult

log = logging.getLogger("lmforge.tokenize")

TOKENIZER_KIND = "tokenizer"
SHARDS_KIND = "token-shards"
ENCODE_BATCH_DOCS = 256
# A token of a byte-level BPE or SentencePiece vocabulary rarely spans more bytes than this: a val split with
# this many bytes per missing token cannot fall short, so the counting pass is skipped.
_BYTES_PER_TOKEN_BOUND = 32


class SplitPlan:
    """Assign documents (identified by stream position and id) to ``train`` or ``val``.

    :meth:`observe` every document once, in stream order; when :meth:`needs_counting`, give :meth:`widen` the
    token counts of the documents below ``max_val_fraction``; then call :meth:`split` for each. ``val`` is every
    document whose bucket is below :attr:`threshold`. When that leaves ``val`` empty, the document with the
    smallest bucket moves to ``val``; when it leaves ``train`` empty, the one with the largest bucket moves to
    ``train``. Memory is constant.
    """

    def __init__(self, cfg: TokenizeConfig) -> None:
        self.val_fraction = cfg.val_fraction
        self.max_val_fraction = max(cfg.max_val_fraction, cfg.val_fraction)
        self.min_tokens = cfg.min_val_tokens
        self.min_documents = cfg.min_val_documents
        self.threshold = cfg.val_fraction
        self.documents = 0
        self.val = 0
        self.val_bytes = 0
        self._lowest = (2.0, -1)  # (bucket, position) of the document most likely to be val
        self._highest = (-1.0, -1)

    def observe(self, position: int, doc_id: str, n_bytes: int = 0) -> None:
        """Count one document (``n_bytes``: its UTF-8 length) of the stream."""
        bucket = split_bucket(doc_id)
        self.documents += 1
        if bucket < self.threshold:
            self.val += 1
            self.val_bytes += n_bytes
        self._lowest = min(self._lowest, (bucket, position))
        self._highest = max(self._highest, (bucket, position))

    def needs_counting(self) -> bool:
        """Whether ``val_fraction``'s documents may hold fewer than the minimum tokens or documents."""
        if self.max_val_fraction <= self.val_fraction or self.documents < 2:
            return False
        return self.val < self.min_documents or self.val_bytes < self.min_tokens * _BYTES_PER_TOKEN_BOUND

    def widen(self, counts: list[tuple[float, int]]) -> None:
        """Raise :attr:`threshold` from the ``(bucket, tokens)`` of every document below ``max_val_fraction``:
        the documents join ``val`` in bucket order until it holds the minimum tokens and documents."""
        counts = sorted(counts)
        buckets = [bucket for bucket, _ in counts]
        take = bisect.bisect_left(buckets, self.val_fraction)  # below val_fraction: val in any case
        tokens = sum(n for _, n in counts[:take])
        while take < len(counts) and (tokens < self.min_tokens or take < self.min_documents):
            tokens += counts[take][1]
            take += 1
        self.threshold = buckets[take] if take < len(counts) else self.max_val_fraction
        self.val = take

    def split(self, position: int, doc_id: str) -> str:
        """``val`` or ``train`` for the document at ``position`` of the stream."""
        if self.documents >= 2:
            if self.val == 0 and position == self._lowest[1]:
                return "val"
            if self.val == self.documents and position == self._highest[1]:
                return "train"
        return "val" if split_bucket(doc_id) < self.threshold else "train"


def _token_counts(cleaned: str | Path, tokenizer: Any, below: float) -> list[tuple[float, int]]:
    """``(bucket, tokens with EOS)`` of every cleaned document whose bucket is below ``below``."""
    counts: list[tuple[float, int]] = []
    rows = ((split_bucket(row["id"]), row["text"]) for row in read_cleaned(cleaned, verify=False))
    candidates = ((bucket, text) for bucket, text in rows if bucket < below)
    while batch := list(islice(candidates, ENCODE_BATCH_DOCS)):
        encoded = tokenizer([text for _, text in batch], add_special_tokens=False)["input_ids"]
        counts += [(bucket, len(ids) + 1) for (bucket, _), ids in zip(batch, encoded, strict=True)]
    return counts


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
    plan = SplitPlan(cfg)
    with (
        tempfile.TemporaryDirectory(prefix="lmforge-tokenize-") as workdir,
        staged_output(tokenizer) as tok_stage,
        staged_output(shards) as shard_stage,
    ):
        start = time.perf_counter()
        inputs: dict[str, object] = {"cleaned": cleaned_record}
        bpe, source = _tokenizer_for(cfg, _planned_texts(cleaned, plan), base_model, workdir, inputs)
        if plan.documents == 0:
            raise InputDataError(f"{cleaned}: the cleaned corpus has no documents")
        if plan.needs_counting():
            plan.widen(_token_counts(cleaned, bpe, plan.max_val_fraction))
        fingerprint = _write_tokenizer(tok_stage, bpe, cfg, inputs, source)
        vocab_size = len(bpe)
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
        start = time.perf_counter()
        index = _write_shards(shard_stage, bpe, fingerprint, cfg, cleaned, plan)
        metrics = _shard_metrics(index, plan, vocab_size, time.perf_counter() - start)
        _warn_of_a_small_val_split(index["splits"]["val"], plan, cfg)
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


def _planned_texts(cleaned: str | Path, plan: SplitPlan) -> Iterator[str]:
    """The cleaned documents' texts (checksums verified), each observed by ``plan`` as it passes."""
    for position, row in enumerate(read_cleaned(cleaned, verify=True)):
        plan.observe(position, row["id"], len(row["text"].encode("utf-8")))
        yield row["text"]


def _tokenizer_for(
    cfg: TokenizeConfig, texts: Iterator[str], base_model: str | Path | None, workdir: str, inputs: dict[str, object]
) -> tuple[Any, str]:
    """``(tokenizer, source)``: a BPE trained on ``texts`` (``trained``), or the base model's (``base_model``, then
    recorded in ``inputs``); ``texts`` is read to its end either way."""
    if base_model is None:
        bpe = train_bpe_tokenizer(
            texts,
            vocab_size=cfg.vocab_size,
            min_frequency=cfg.min_frequency,
            eos_token=cfg.eos_token,
            pad_token=cfg.pad_token,
        )
        return bpe, "trained"
    # Reading a base model's folder takes transformers' Auto classes, which import torch: only on this path.
    from lmforge.model.base import base_tokenizer, fetch_metadata, refuse_unusable_base

    local = fetch_metadata(base_model, workdir)
    refuse_unusable_base(local, base_model)
    bpe = base_tokenizer(local)
    for _ in texts:  # the split plan still needs one pass
        pass
    inputs["base_model"] = _base_record(str(base_model), local)
    return bpe, "base_model"


def _write_tokenizer(stage: Path, bpe: Any, cfg: TokenizeConfig, inputs: dict[str, object], source: str) -> str:
    """Save the tokenizer artifact (files and manifest) in ``stage``; return its fingerprint."""
    save_tokenizer(bpe, stage)
    fingerprint = tokenizer_fingerprint(stage)
    write_manifest(
        stage,
        TOKENIZER_KIND,
        inputs=inputs,
        config=cfg.model_dump(),
        metrics={"vocab_size": len(bpe)},
        extra={
            "tokenizer_sha256": fingerprint,
            "source": source,
            "special_tokens": {"eos": bpe.eos_token, "pad": bpe.pad_token, "bos": bpe.bos_token},
        },
    )
    return fingerprint


def _write_shards(
    stage: Path, bpe: Any, fingerprint: str, cfg: TokenizeConfig, cleaned: str | Path, plan: SplitPlan
) -> dict[str, Any]:
    """Encode the cleaned documents in batches, each ended by EOS, into ``plan``'s split's shards; the index."""
    eos_id = bpe.eos_token_id
    writer = ShardWriter(
        stage, vocab_size=len(bpe), eos_id=eos_id, tokenizer_sha256=fingerprint, shard_tokens=cfg.shard_tokens
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
    return writer.close()


def _warn_of_a_small_val_split(val: dict[str, int], plan: SplitPlan, cfg: TokenizeConfig) -> None:
    """Warn when the val split is empty or holds fewer tokens or documents than the configured minimums."""
    if val["documents"] == 0:
        log.warning("only %d document: the val split is empty", plan.documents)
    elif val["tokens"] < cfg.min_val_tokens or val["documents"] < cfg.min_val_documents:
        log.warning(
            "the val split holds %d tokens in %d documents, below min_val_tokens %d / min_val_documents %d even "
            "at max_val_fraction %g: evaluation marks its held-out figures low confidence",
            val["tokens"],
            val["documents"],
            cfg.min_val_tokens,
            cfg.min_val_documents,
            plan.max_val_fraction,
        )


def _shard_metrics(index: dict[str, Any], plan: SplitPlan, vocab_size: int, seconds: float) -> dict[str, float]:
    """The token shards' metrics: documents and tokens per split, the val threshold, shards, encoding speed."""
    splits = index["splits"]
    total_tokens = splits["train"]["tokens"] + splits["val"]["tokens"]
    return {
        "vocab_size": vocab_size,
        "documents": plan.documents,
        "train_documents": splits["train"]["documents"],
        "val_documents": splits["val"]["documents"],
        "train_tokens": splits["train"]["tokens"],
        "val_tokens": splits["val"]["tokens"],
        "val_threshold": plan.threshold,
        "shards": len(index["shards"]),
        "tokens_per_sec": total_tokens / max(seconds, 1e-9),
    }
