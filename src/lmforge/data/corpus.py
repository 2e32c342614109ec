"""Stream documents from a raw corpus URI.

A corpus URI is a local file, a local directory (every supported file below it, sorted), a glob
(``data/*.jsonl.gz``; matches sorted), an ``s3://`` object or prefix (downloaded into a temporary
directory first), or a ``demo://`` corpus. Formats by extension:

* ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``, ``.json``: one JSON object per line; the text is in
  ``text_field``. A truncated or corrupt compressed stream counts as one bad record and ends that file.
* ``.parquet``: one document per row; the text is in the ``text_field`` column. An unreadable file counts as
  one bad record. A row group whose text and id columns hold more than ``max_record_bytes`` (file metadata)
  has each row's size measured in Arrow before it becomes Python objects, and a larger row is one bad record.
* ``.txt``: the whole file is one document.

No record can crash the reader or take unbounded memory: a line longer than ``max_record_bytes`` (read and
dropped in chunks up to its newline), a ``.txt`` file or Parquet row larger than that, invalid UTF-8, invalid
JSON and JSON nested too deeply to parse are each one bad record (:mod:`lmforge.data.jsonl`). A UTF-8 byte order mark at
the start of a file is accepted.

Reading a local folder or glob never leaves it: a symbolic link below the folder (or below the glob's fixed
leading folders), to a file or a folder, is refused with :class:`~lmforge.errors.UnsafePathError` naming it and
its target, before any document is read.

Every document carries ``source`` (``file:line``, ``file:row`` for Parquet, ``file`` for text files)
and ``id`` (the record's ``id`` when present, else a stable hash of ``source``). Malformed records are
counted (and passed to ``on_bad`` when given); one more than ``max_bad_records`` raises
:class:`InputDataError` naming ``file:line``.

Each document also carries ``key``, its position in the whole corpus (file ordinal in the high bits,
line or row in the low bits). Reading shard ``i`` of ``n`` yields a disjoint part of the corpus with the
same keys as a full read: whole files ``i, i+n, ...`` when there are at least ``n`` files, else every
``n``-th record of each file. Dedup keeps the smallest key of a cluster, so results do not depend on ``n``.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import itertools
import logging
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge import storage
from lmforge.data import jsonl
from lmforge.data.demo import is_demo, materialize
from lmforge.errors import FieldMissingError, InputDataError, UnsafePathError
from lmforge.scratch import scratch_dir

log = logging.getLogger("lmforge.corpus")

JSON_LINES_SUFFIXES = (".jsonl.gz", ".jsonl.zst", ".jsonl", ".json")
SUFFIXES = (*JSON_LINES_SUFFIXES, ".parquet", ".txt")
BAD_SAMPLES_KEPT = 1000
_GLOB_CHARS = frozenset("*?[")
_PARQUET_BATCH = 1024
RECORD_BITS = 40  # records per file < 2**40; files < 2**23
FIELDS_KEPT = 20  # field names kept and shown for a record without its text field
FIELD_NAME_SHOWN = 40


def document_key(file_index: int, record: int) -> int:
    """A document's position in the corpus, independent of sharding."""
    return (file_index << RECORD_BITS) | record


@dataclass(frozen=True)
class Document:
    """One raw document and where it came from."""

    id: str
    text: str
    source: str
    key: int = 0


@dataclass(frozen=True)
class BadRecord:
    """A record that could not be read as a document.

    ``fields`` are the (first :data:`FIELDS_KEPT`) keys of a JSON object whose text field is missing, and
    ``text_fields`` those of them holding a string, longest value first.
    """

    source: str
    problem: str
    fields: tuple[str, ...] | None = None
    text_fields: tuple[str, ...] = ()


def field_list(fields: Sequence[str], total: int) -> str:
    """Field names for a one-line message: quoted (a newline in a name stays escaped), at most :data:`FIELDS_KEPT`."""
    shown = ", ".join(repr(f[:FIELD_NAME_SHOWN]) for f in fields[:FIELDS_KEPT])
    more = f" and {total - FIELDS_KEPT} more" if total > FIELDS_KEPT else ""
    return (shown + more) or "no fields"


def stable_id(source: str) -> str:
    """A short, stable id derived from a document's ``source``."""
    return hashlib.sha1(source.encode("utf-8")).hexdigest()[:16]


def format_of(path: str | Path) -> str | None:
    """The supported suffix ``path`` ends with (``.jsonl.gz``, ``.txt``, ...), or ``None``."""
    name = str(path).lower()
    return next((s for s in SUFFIXES if name.endswith(s)), None)


class CorpusReader:
    """Iterate the documents of a corpus URI, counting malformed records.

    Iterating streams file by file and line by line; only one ``.txt`` document or one Parquet batch
    is held at a time. ``bad_records`` counts every malformed record seen so far and ``bad_samples``
    keeps the first :data:`BAD_SAMPLES_KEPT` of them.
    """

    def __init__(
        self,
        uri: str | Path,
        *,
        text_field: str = "text",
        max_bad_records: int = 0,
        shard: tuple[int, int] = (0, 1),
        on_bad: Callable[[BadRecord], None] | None = None,
        max_record_bytes: int = jsonl.DEFAULT_MAX_RECORD_BYTES,
    ) -> None:
        index, count = shard
        self.on_bad = on_bad
        if not 0 <= index < count:
            raise InputDataError(f"shard index {index} is outside 0..{count - 1}")
        self.shard = shard
        self.uri = str(uri)
        self.text_field = text_field
        self.max_bad_records = max_bad_records
        self.max_record_bytes = max_record_bytes
        self.bad_records = 0
        self.bad_samples: list[BadRecord] = []
        self.files: list[str] = []

    def __iter__(self) -> Iterator[Document]:
        index, count = self.shard
        with scratch_dir("lmforge-corpus-download-") as workdir:
            files = self._resolve(Path(workdir))
            by_file = len(files) >= count
            for file_index, (path, name) in enumerate(files):
                if by_file and file_index % count != index:
                    continue
                self.files.append(name)
                log.debug("reading %s", name)
                stripe = (0, 1) if by_file else (index, count)
                yield from self._read_file(path, name, file_index, stripe)

    def _resolve(self, workdir: Path) -> list[tuple[Path, str]]:
        """``(local path, display name)`` of every corpus file, in reading order."""
        uri = self.uri
        if is_demo(uri):
            return self._check_files([(materialize(uri, workdir), uri)], explicit=True)
        if storage.is_s3(uri):
            if not storage.exists(uri):
                raise InputDataError(f"corpus not found: {uri}")
            local = storage.localize(uri, workdir)
            base = uri.rstrip("/")
            if local.is_file():
                return self._check_files([(local, uri)], explicit=True)
            files = [(p, f"{base}/{p.relative_to(local).as_posix()}") for p in _files_below(local)]
            return self._check_files(files, explicit=False)
        path = Path(uri)
        if path.is_file():
            return self._check_files([(path, uri)], explicit=True)
        if path.is_dir():
            return self._check_files([(p, str(p)) for p in _files_below(path)], explicit=False)
        if _GLOB_CHARS & set(uri):
            matches = sorted(glob.glob(uri, recursive=True))
            files = [(Path(m), m) for m in matches if _no_link_below(_glob_base(uri), Path(m)).is_file()]
            if not files:
                raise InputDataError(f"corpus not found: {uri} (the pattern matches no files)")
            return self._check_files(files, explicit=False)
        raise InputDataError(f"corpus not found: {uri}")

    def _check_files(self, files: list[tuple[Path, str]], *, explicit: bool) -> list[tuple[Path, str]]:
        """Keep supported formats; an explicitly named file of another format is an error."""
        supported = [(p, n) for p, n in files if format_of(p)]
        if explicit and not supported:
            raise InputDataError(f"corpus {self.uri}: unsupported file type; expected one of {', '.join(SUFFIXES)}")
        for path, name in files:
            if not format_of(path):
                log.warning("skipping %s: not one of %s", name, ", ".join(SUFFIXES))
        if not supported:
            raise InputDataError(f"corpus {self.uri}: no {', '.join(SUFFIXES)} files found")
        return supported

    def _bad(self, bad: BadRecord) -> None:
        self.bad_records += 1
        if len(self.bad_samples) < BAD_SAMPLES_KEPT:
            self.bad_samples.append(bad)
        if self.on_bad is not None:
            self.on_bad(bad)
        if self.bad_records > self.max_bad_records:
            message = (
                f"{bad.source}: {bad.problem} (bad record {self.bad_records} exceeds "
                f"max_bad_records={self.max_bad_records})"
            )
            if bad.fields is not None:
                raise FieldMissingError(message, field=self.text_field, fields=bad.fields, text_fields=bad.text_fields)
            raise InputDataError(message)
        log.warning("%s: %s (skipped; bad record %d)", bad.source, bad.problem, self.bad_records)

    def _read_file(self, path: Path, name: str, file_index: int, stripe: tuple[int, int]) -> Iterator[Document]:
        suffix = format_of(path)
        if suffix in JSON_LINES_SUFFIXES:
            yield from self._read_json_lines(path, name, file_index, stripe, suffix)
        elif suffix == ".parquet":
            yield from self._read_parquet(path, name, file_index, stripe)
        elif stripe[0] == 0:  # a text file is one record: the first stripe owns it
            yield from self._read_text(path, name, file_index)

    def _read_json_lines(
        self, path: Path, name: str, file_index: int, stripe: tuple[int, int], suffix: str
    ) -> Iterator[Document]:
        index, count = stripe
        with _open_lines(path, suffix) as fh:
            lines = jsonl.iter_json_lines(
                fh,
                max_bytes=self.max_record_bytes,
                wanted=lambda lineno: lineno % count == index,
                stream_errors=_stream_errors(suffix),
            )
            for lineno, record in lines:
                source = f"{name}:{lineno}"
                if isinstance(record, jsonl.BadLine):
                    self._bad(BadRecord(source, record.problem))
                elif (doc := self._document(record, source, document_key(file_index, lineno))) is not None:
                    yield doc

    def _read_parquet(self, path: Path, name: str, file_index: int, stripe: tuple[int, int]) -> Iterator[Document]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        row = 0
        try:  # pyarrow's errors are OSError (I/O) or ValueError (ArrowInvalid: not Parquet, corrupt pages)
            parquet = pq.ParquetFile(path)
            schema = parquet.schema_arrow
            if self.text_field not in schema.names:
                text_columns = tuple(
                    f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)
                )
                raise FieldMissingError(
                    f"{name}: no column {self.text_field!r} (columns: {field_list(schema.names, len(schema.names))})",
                    field=self.text_field,
                    fields=tuple(schema.names[:FIELDS_KEPT]),
                    text_fields=text_columns[:FIELDS_KEPT],
                )
            columns = [c for c in (self.text_field, "id") if c in parquet.schema_arrow.names]
            for group in range(parquet.num_row_groups):
                checked = _column_bytes(parquet.metadata.row_group(group), columns) > self.max_record_bytes
                for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH, row_groups=[group], columns=columns):
                    sizes = _record_bytes(batch) if checked else None
                    for index, record in enumerate(_records(batch, sizes, self.max_record_bytes)):
                        row += 1
                        if row % stripe[1] != stripe[0]:
                            continue
                        source = f"{name}:{row}"
                        if record is None:
                            problem = f"record larger than {self.max_record_bytes} bytes ({sizes[index]} bytes)"
                            self._bad(BadRecord(source, problem))
                        elif (doc := self._document(record, source, document_key(file_index, row))) is not None:
                            yield doc
        except (OSError, ValueError) as exc:
            if stripe[0] == 0:  # one bad record for the file, counted once
                self._bad(BadRecord(f"{name}:{row + 1}", f"not a readable Parquet file, rest of file skipped ({exc})"))

    def _read_text(self, path: Path, name: str, file_index: int) -> Iterator[Document]:
        with open(path, "rb") as fh:
            data = fh.read(self.max_record_bytes + 1)
        if len(data) > self.max_record_bytes:
            self._bad(BadRecord(name, f"text file larger than {self.max_record_bytes} bytes"))
            return
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            self._bad(BadRecord(name, f"invalid UTF-8 at byte {exc.start}"))
            return
        yield Document(id=stable_id(name), text=text, source=name, key=document_key(file_index, 0))

    def _document(self, record: Any, source: str, key: int) -> Document | None:
        """The document in one parsed record, or ``None`` after counting it as bad."""
        if not isinstance(record, dict):
            self._bad(BadRecord(source, f"expected a JSON object, got {type(record).__name__}"))
            return None
        if self.text_field not in record:
            fields = tuple(str(k)[:FIELD_NAME_SHOWN] for k in itertools.islice(record, FIELDS_KEPT))
            strings = sorted((k for k, v in record.items() if isinstance(v, str)), key=lambda k: -len(record[k]))
            problem = f"field {self.text_field!r} missing (the record has: {field_list(fields, len(record))})"
            self._bad(BadRecord(source, problem, fields, tuple(k[:FIELD_NAME_SHOWN] for k in strings[:FIELDS_KEPT])))
            return None
        text = record[self.text_field]
        if not isinstance(text, str):
            self._bad(BadRecord(source, f"field {self.text_field!r} is not a string (got {type(text).__name__})"))
            return None
        raw_id = record.get("id")
        has_id = isinstance(raw_id, str | int) and not isinstance(raw_id, bool) and str(raw_id) != ""
        doc_id = str(raw_id) if has_id else stable_id(source)
        return Document(id=doc_id, text=text, source=source, key=key)


def _column_bytes(row_group: Any, columns: Sequence[str]) -> int:
    """Uncompressed bytes of ``columns`` in one Parquet row group (file metadata; nothing is read).

    No value of the row group is larger, so a row group within the record limit needs no check per record.
    """
    chunks = (row_group.column(i) for i in range(row_group.num_columns))
    return sum(c.total_uncompressed_size for c in chunks if c.path_in_schema.split(".")[0] in columns)


def _record_bytes(batch: Any) -> list[int]:
    """Bytes of each row of a Parquet batch: the lengths of its string and binary values (other types: 0)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    total = pa.array([0] * batch.num_rows, pa.int64())
    for column in batch.columns:
        kind = column.type
        if (
            pa.types.is_string(kind)
            or pa.types.is_large_string(kind)
            or pa.types.is_binary(kind)
            or pa.types.is_large_binary(kind)
        ):
            total = pc.add(total, pc.fill_null(pc.binary_length(column).cast(pa.int64()), 0))
    return total.to_pylist()


def _records(batch: Any, sizes: list[int] | None, limit: int) -> Iterator[dict[str, Any] | None]:
    """The rows of a Parquet batch as dicts; ``None`` for a row longer than ``limit`` bytes (never converted)."""
    if sizes is None or max(sizes, default=0) <= limit:
        yield from batch.to_pylist()
        return
    for index, size in enumerate(sizes):
        yield None if size > limit else batch.slice(index, 1).to_pylist()[0]


def _stream_errors(suffix: str) -> tuple[type[BaseException], ...]:
    """What a truncated or corrupt compressed file raises while it is read."""
    if suffix == ".jsonl.gz":
        return (OSError, EOFError, ValueError, zlib.error)
    if suffix == ".jsonl.zst":
        import zstandard

        return (OSError, EOFError, ValueError, zstandard.ZstdError)
    return ()


def _open_lines(path: Path, suffix: str) -> Any:
    """A binary line reader over a plain, gzip or zstd file."""
    if suffix == ".jsonl.gz":
        return gzip.open(path, "rb")
    if suffix == ".jsonl.zst":
        import io

        import zstandard

        raw = open(path, "rb")  # noqa: SIM115 - closed with the returned reader
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return open(path, "rb")


def _hidden(relative: str) -> bool:
    return any(part.startswith(".") for part in relative.split("/"))


def _files_below(root: Path) -> list[Path]:
    """Every non-hidden file under ``root``, sorted by relative path; a symbolic link below ``root`` is refused."""
    return [root / name for name in storage.local_files(root) if not _hidden(name)]


def _glob_base(pattern: str) -> Path:
    """The folder a glob pattern searches: its path up to the first segment with a glob character."""
    return Path(*itertools.takewhile(lambda part: not _GLOB_CHARS & set(part), Path(pattern).parts))


def _no_link_below(base: Path, match: Path) -> Path:
    """``match``, after checking that neither it nor a folder between ``base`` and it is a symbolic link.

    Raises:
        UnsafePathError: naming the link and its target.
    """
    current = base
    for part in match.relative_to(base).parts:
        current = current / part
        if current.is_symlink():
            raise UnsafePathError(
                f"{current} is a symbolic link (to {os.readlink(current)}); lmforge reads only regular files "
                f"inside the folder it is given ({base}), copy the file in instead"
            )
    return match


def first_file_uri(uri: str) -> str:
    """For an ``s3://`` prefix, the first corpus file a :class:`CorpusReader` reads there; other URIs unchanged.

    A reader over a prefix downloads the whole prefix before its first document; a sample read from this
    URI downloads one object. A prefix without supported files is returned as is (the reader names the problem).
    """
    if not storage.is_s3(uri) or storage.is_file(uri):
        return uri
    names = [n for n in storage.list_files(uri) if format_of(n) and not _hidden(n)]
    return storage.join(uri, names[0]) if names else uri


def iter_documents(
    uri: str | Path,
    *,
    text_field: str = "text",
    max_bad_records: int = 0,
    shard: tuple[int, int] = (0, 1),
    max_record_bytes: int = jsonl.DEFAULT_MAX_RECORD_BYTES,
) -> Iterator[Document]:
    """Stream the documents of ``uri`` (see :class:`CorpusReader`)."""
    yield from CorpusReader(
        uri, text_field=text_field, max_bad_records=max_bad_records, shard=shard, max_record_bytes=max_record_bytes
    )
