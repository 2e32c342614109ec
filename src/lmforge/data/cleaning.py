"""What ``clean_shard`` does to each document, and the quarantine sample it and ``merge_shards`` write.

:class:`Normalize` and :func:`build_rules` (also run by preflight's retention prediction), the per-document
cleaner and its process pool (:func:`cleaned_chunks`), and :class:`Quarantine`. The files themselves are
:mod:`lmforge.formats.cleaned`.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import re
import unicodedata
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np

from lmforge.config import CleanConfig
from lmforge.data.corpus import Document
from lmforge.data.minhash import MinHasher
from lmforge.data.pii import PiiRedactor
from lmforge.data.rules import (
    C4Lines,
    FineWebLines,
    GopherQuality,
    GopherRepetition,
    LanguageFilter,
    MinChars,
    MinWords,
    NonEmpty,
    Rule,
    TextView,
)
from lmforge.errors import WorkerLostError
from lmforge.formats.dedup import exact_digest

QUARANTINE_TEXT_CHARS = 2000
_NO_SIGNATURE = np.empty(0, dtype=np.uint32)  # near dedup off: signatures are empty

# C0/C1 controls except tab and newline, and the byte order mark that editors leave at the start of files
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ufeff]")
# A run of whitespace without a newline that is not already a single space; matching lone spaces too
# makes ``sub`` several times slower on ordinary prose.
_HSPACE = re.compile(r"[^\S\n]{2,}|[^\S\n ]")
_ODD_SPACE = re.compile(r"[^\S\n ]")  # whitespace other than newline and space: a one-class scan, faster


class Normalize:
    """Unicode normalization, line endings to ``\\n``, control characters dropped, spaces collapsed.

    Newlines are kept (they carry structure such as verse and paragraphs); a run of spaces and tabs
    becomes one space, and spaces next to a newline and at either end of the text are removed.
    """

    def __init__(self, form: str) -> None:
        self.form = form
        self.changed = 0

    def __call__(self, text: str) -> str:
        out = unicodedata.normalize(self.form, text)
        out = out.replace("\r\n", "\n").replace("\r", "\n")
        out = _CONTROL.sub("", out)
        if "  " in out or _ODD_SPACE.search(out):  # else _HSPACE has nothing to replace
            out = _HSPACE.sub(" ", out)
        out = out.replace(" \n", "\n").replace("\n ", "\n").strip()
        if out != text:
            self.changed += 1
        return out


def build_rules(cfg: CleanConfig) -> list[Rule]:
    """The per-document rules of ``cfg`` in the order they run (FineWeb's order: language ID, Gopher
    repetition, Gopher quality, C4, FineWeb). Dedup runs after all of them, over the survivors."""
    rules: list[Rule] = [NonEmpty(), MinChars(cfg.min_chars), MinWords(cfg.min_words)]
    if cfg.language.enabled:
        rules.append(LanguageFilter(cfg.language))
    if cfg.gopher_repetition.enabled:
        rules.append(GopherRepetition(cfg.gopher_repetition))
    if cfg.gopher_quality.enabled:
        rules.append(GopherQuality(cfg.gopher_quality))
    if cfg.c4.enabled:
        rules.append(C4Lines(cfg.c4))
    if cfg.fineweb.enabled:
        rules.append(FineWebLines(cfg.fineweb))
    return rules


class Quarantine:
    """``quarantine.jsonl``: at most ``per_rule`` rejected documents per rule, with the reason."""

    def __init__(self, fh: Any, per_rule: int) -> None:
        self.fh = fh
        self.per_rule = per_rule
        self.kept: Counter[str] = Counter()

    def add(self, record: dict[str, Any]) -> None:
        if self.kept[record["rule"]] < self.per_rule:
            self.kept[record["rule"]] += 1
            self.fh.write(json.dumps(record, ensure_ascii=False) + "\n")

    def add_document(self, rule: str, reason: str, doc: Document | dict[str, Any]) -> None:
        text = doc.text if isinstance(doc, Document) else doc["text"]
        source = doc.source if isinstance(doc, Document) else doc["source"]
        doc_id = doc.id if isinstance(doc, Document) else doc["id"]
        cut = text[:QUARANTINE_TEXT_CHARS]
        record = {"rule": rule, "reason": reason, "source": source, "id": doc_id, "text": cut}
        self.add({**record, "truncated": len(text) > len(cut)})


_CHUNK_DOCS = 32  # documents per task for a worker process: amortizes pickling; small, so the last ends soon
_POOL_MIN_CHUNKS = 16  # smaller shards are cleaned in-process: a worker process takes about half a second to start
_BACKLOG_CHUNKS = 8  # chunks queued per worker process: covers a row group written and a chunk cleaned here
_HELD_CHUNKS = 2 * _BACKLOG_CHUNKS  # chunks held per worker (queued, or cleaned and waiting for their turn)


class _DocCleaner:
    """The per-document work of the ``clean_shard`` stage: normalize, rules, PII redaction, dedup signature.

    One lives in the stage's process, or one in each worker process of its pool; :meth:`counters` hands
    over what it counted since the last call, so that the stage can add up the workers' counts.
    """

    def __init__(self, cfg: CleanConfig) -> None:
        self.normalize = Normalize(cfg.unicode_form)
        self.rules = build_rules(cfg)
        self.redact = PiiRedactor(cfg.pii)
        self.hasher = MinHasher(cfg.near_dedup) if cfg.near_dedup.enabled else None

    def clean(self, text: str) -> tuple[str, str] | tuple[str, str, bytes, np.ndarray]:
        """``(rule, reason)`` for a rejected document; ``(text, lang, exact digest, signature)`` for a kept one."""
        view = TextView(self.normalize(text))
        rejected = next(((r.name, why) for r in self.rules if (why := r(view)) is not None), None)
        if rejected is not None:
            return rejected
        text = self.redact(view.text)
        if text != view.text:
            view.replace_text(text)
        signature = self.hasher.view_signature(view) if self.hasher is not None else _NO_SIGNATURE
        return text, view.lang, exact_digest(text), signature

    def clean_chunk(self, texts: list[str]) -> _Cleaned:
        """The results of :meth:`clean` for ``texts``, in their order, and the counters they moved."""
        return [self.clean(text) for text in texts], self.counters()

    def counters(self) -> dict[str, Any]:
        """The counts since the last call (rules in their order, normalization, C4 lines, PII); then reset."""
        out = {
            "removed": {r.name: r.removed for r in self.rules},
            "reasons": {r.name: Counter(r.reasons) for r in self.rules},
            "docs_normalized": self.normalize.changed,
            "c4_lines_removed": sum(getattr(r, "lines_removed", 0) for r in self.rules),
            "pii_docs": self.redact.docs,
            "pii": Counter(self.redact.counts),
        }
        for rule in self.rules:
            rule.removed = 0
            rule.reasons.clear()
            if hasattr(rule, "lines_removed"):
                rule.lines_removed = 0
        self.normalize.changed = self.redact.docs = 0
        self.redact.counts = Counter(dict.fromkeys(self.redact.counts, 0))
        return out


def add_counters(total: dict[str, Any] | None, part: dict[str, Any]) -> dict[str, Any]:
    """``part``'s cleaning counters added to ``total`` (``part`` itself when there is no total yet)."""
    if total is None:
        return part
    for name, n in part["removed"].items():
        total["removed"][name] += n
        total["reasons"][name].update(part["reasons"][name])
    for key in ("docs_normalized", "c4_lines_removed", "pii_docs"):
        total[key] += part[key]
    total["pii"].update(part["pii"])
    return total


_WORKER: _DocCleaner | None = None  # the cleaner of a pool worker process (set by its initializer)


def _init_worker(cfg: CleanConfig) -> None:
    global _WORKER
    _WORKER = _DocCleaner(cfg)


_Cleaned = tuple[list[Any], dict[str, Any]]  # a chunk's results (in its order) and the counters it moved
_Held = deque[tuple[list[Document], "Future[_Cleaned] | _Cleaned"]]  # chunks in corpus order, with their results


def _clean_chunk(texts: list[str]) -> _Cleaned:
    assert _WORKER is not None, "_init_worker did not run in this process"
    return _WORKER.clean_chunk(texts)


def cleaned_chunks(cfg: CleanConfig, docs: Iterator[Document], workers: int) -> Iterator[tuple[list[Document], Any]]:
    """``(documents, (results, counters))`` for consecutive chunks of ``docs``, in corpus order.

    With one worker, or a shard too small to repay starting processes, everything runs here. Otherwise this
    process is one of the ``workers``: a pool of ``workers - 1`` processes gets a backlog of
    ``_BACKLOG_CHUNKS`` chunks each, deep enough to outlast this process's pauses (a Parquet row group
    written, a chunk cleaned here); whenever the backlog is full, this process cleans the next chunk
    itself. When the input ends, it takes back the chunks the pool has not started and cleans them too, so
    that the processes finish within a few chunks of each other. At most ``_HELD_CHUNKS * workers`` chunks are
    held (memory stays bounded by the chunk size). The last item carries an empty chunk and counters.
    """
    chunks = _chunked(docs, _CHUNK_DOCS)
    head = list(itertools.islice(chunks, _POOL_MIN_CHUNKS))
    here = _DocCleaner(cfg)

    def clean_here(chunk: list[Document]) -> _Cleaned:
        return here.clean_chunk([d.text for d in chunk])

    if workers <= 1 or len(head) < _POOL_MIN_CHUNKS:
        for chunk in itertools.chain(head, chunks):
            yield chunk, clean_here(chunk)
        yield [], ([], here.counters())
        return
    context = multiprocessing.get_context("spawn")  # no fork of a process that runs pyarrow's threads
    helpers = workers - 1
    pool = ProcessPoolExecutor(helpers, mp_context=context, initializer=_init_worker, initargs=(cfg,))
    try:
        held: _Held = deque()
        for chunk in itertools.chain(head, chunks):
            backlog = sum(1 for _, result in held if _pending(result))
            if backlog < _BACKLOG_CHUNKS * helpers:
                held.append((chunk, _submitted(pool, chunk)))
            else:
                held.append((chunk, clean_here(chunk)))
            while held and (len(held) > _HELD_CHUNKS * workers or not _pending(held[0][1])):
                done, result = held.popleft()
                yield done, _resolved(done, result)
        _take_back(held, clean_here)
        while held:
            done, result = held.popleft()
            yield done, _resolved(done, result)
    finally:  # stopped early (bad input, a failed write): the backlog is dropped, not cleaned
        pool.shutdown(cancel_futures=True)
    yield [], ([], here.counters())


def _submitted(pool: ProcessPoolExecutor, chunk: list[Document]) -> Future[_Cleaned]:
    """``chunk`` sent to the pool. A pool that has noticed a worker's death refuses it: then a future failed with
    that error, so that the chunks before it come out first and the first lost one is named (:func:`_resolved`)."""
    try:
        return pool.submit(_clean_chunk, [d.text for d in chunk])
    except BrokenProcessPool as err:
        refused: Future[_Cleaned] = Future()
        refused.set_exception(err)
        return refused


def _take_back(held: _Held, clean_here: Callable[[list[Document]], _Cleaned]) -> None:
    """Clean here, from the end, the chunks of ``held`` that the pool has not begun (it works from the front)."""
    for at in reversed(range(len(held))):
        chunk, result = held[at]
        if not isinstance(result, Future):
            continue
        if not result.cancel():
            return  # begun or queued in the pool, as is every chunk before it
        held[at] = (chunk, clean_here(chunk))


def _pending(result: Future[_Cleaned] | _Cleaned) -> bool:
    return isinstance(result, Future) and not result.done()


def _resolved(chunk: list[Document], result: Future[_Cleaned] | _Cleaned) -> _Cleaned:
    if not isinstance(result, Future):
        return result
    try:
        return result.result()
    except BrokenProcessPool as err:
        raise WorkerLostError(
            f"a cleaning worker process died while it held documents {chunk[0].source} to {chunk[-1].source} "
            f"(most often the kernel killed it for memory: raise the pod's memory limit or lower clean.workers): {err}"
        ) from err


def _chunked(docs: Iterator[Document], size: int) -> Iterator[list[Document]]:
    chunk: list[Document] = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
