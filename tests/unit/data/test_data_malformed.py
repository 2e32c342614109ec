"""Malformed input: every bad record counted with file and line, good records all kept; .jsonl.zst input."""

from __future__ import annotations

import gzip
import json

import zstandard

from lmforge.config import CleanConfig
from lmforge.data import clean
from lmforge.data.corpus import iter_documents
from lmforge.formats.cleaned import read_cleaned

RULES_OFF = {
    n: {"enabled": False}
    for n in ("language", "gopher_repetition", "gopher_quality", "c4", "fineweb", "pii", "near_dedup")
}


def test_a_thousand_bad_records_are_counted_and_every_good_record_is_kept(tmp_path):
    src = tmp_path / "raw"
    src.mkdir()
    good: list[str] = []
    expected_bad: set[str] = set()
    lines: list[bytes] = []
    for i in range(1200):
        kind = i % 6
        lineno = len(lines) + 1
        if kind == 0:
            text = f"good document number {i} with a few words"
            good.append(text)
            lines.append(json.dumps({"text": text}).encode())
            continue
        lines.append(
            {
                1: b'{"text": "caf\xe9 invalid utf-8"}',
                2: b"{not json at all",
                3: b'{"body": "text field missing"}',
                4: b'{"text": 12345}',
                5: b'["a", "list"]',
            }[kind]
        )
        expected_bad.add(f"{src / 'a.jsonl'}:{lineno}")
    (src / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (src / "b-empty.jsonl").write_bytes(b"")
    huge = "word " * (2 * 1024 * 1024)  # a 10 MB single line
    good.append(huge.strip())
    (src / "c-huge.jsonl").write_text(json.dumps({"text": huge}) + "\n", encoding="utf-8")
    payload = gzip.compress(b"".join(json.dumps({"text": f"gz doc {i} fine"}).encode() + b"\n" for i in range(50)))
    (src / "d-truncated.jsonl.gz").write_bytes(payload[: len(payload) // 2])

    out = tmp_path / "out"
    result = clean.run(
        CleanConfig.model_validate({**RULES_OFF, "min_chars": 0, "min_words": 0, "max_bad_records": 5000}),
        corpus_uri=str(src),
        cleaned=out,
    )
    bad = result.metrics["bad_records"]
    assert bad >= 1000
    logged = [json.loads(x) for x in (out / "bad_records.jsonl").read_text().splitlines()]
    sources = [b["source"] for b in logged]
    assert bad == len(logged) == len(expected_bad) + 1  # + the truncated gzip member
    assert expected_bad <= set(sources)
    assert next(s for s in sources if s not in expected_bad).startswith(f"{src / 'd-truncated.jsonl.gz'}:")
    texts = [r["text"] for r in read_cleaned(out)]
    assert set(good) <= set(texts)  # every good record kept (the truncated file's readable head too)
    assert [t for t in texts if t.startswith("gz doc")] == [f"gz doc {i} fine" for i in range(len(texts) - len(good))]


def test_bad_record_sources_name_file_and_line(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(b'{"text": "ok"}\n{bad\n{"text": "ok too"}\n\xff\xfe\n')
    reader_docs = list(iter_documents(corpus, max_bad_records=10))
    assert [d.text for d in reader_docs] == ["ok", "ok too"]
    from lmforge.data.corpus import CorpusReader

    reader = CorpusReader(corpus, max_bad_records=10)
    list(reader)
    assert [(b.source, b.problem.split(" (")[0]) for b in reader.bad_samples] == [
        (f"{corpus}:2", "not valid JSON"),
        (f"{corpus}:4", "invalid UTF-8 at byte 0"),
    ]


def test_jsonl_zst_is_read(tmp_path):
    corpus = tmp_path / "c.jsonl.zst"
    raw = b"".join(json.dumps({"text": f"zstd doc {i}"}).encode() + b"\n" for i in range(3))
    corpus.write_bytes(zstandard.ZstdCompressor().compress(raw))
    assert [d.text for d in iter_documents(corpus)] == ["zstd doc 0", "zstd doc 1", "zstd doc 2"]


def test_sharded_reads_partition_the_corpus_with_full_read_keys(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"d{i}"}) + "\n" for i in range(10)))
    full = [(d.key, d.text) for d in iter_documents(corpus)]
    parts = [(d.key, d.text) for i in range(3) for d in iter_documents(corpus, shard=(i, 3))]
    assert sorted(parts) == full


def test_files_are_split_whole_when_there_are_enough(tmp_path):
    for name in "abcd":
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"text": name}) + "\n")
    assert [d.text for d in iter_documents(tmp_path, shard=(1, 2))] == ["b", "d"]
