"""Hostile records: no crash, every bad record counted with file:line, every good record kept, bounded memory.

The whole-corpus case runs the clean stage in a child process on a corpus with every kind of bad record, including
a gzip bomb (a 4.7 MB ``.jsonl.gz`` that inflates to 1 GiB with no newline), and measures that child's peak RSS
with ``getrusage(RUSAGE_CHILDREN)`` from a wrapper process whose only child it is.
"""

from __future__ import annotations

import codecs
import gzip
import json
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path

import pytest

from lmforge.config import CleanConfig
from lmforge.data.corpus import CorpusReader
from lmforge.data.qa import load_examples
from lmforge.errors import InputDataError

BOM = codecs.BOM_UTF8
GIB = 1 << 30
RULES_OFF = {
    n: {"enabled": False}
    for n in ("language", "gopher_repetition", "gopher_quality", "c4", "fineweb", "pii", "near_dedup")
}


def _good(i: int) -> bytes:
    return json.dumps({"text": f"good document {i}"}).encode()


def _gzip_bomb(path: Path, inflated: int) -> None:
    """``good document 0``, then ``inflated`` bytes without a newline, compressed chunk by chunk (never held)."""
    compressor = zlib.compressobj(1, zlib.DEFLATED, 31)  # wbits 31: a gzip stream
    chunk = b"a" * (1 << 20)
    with open(path, "wb") as fh:
        fh.write(compressor.compress(_good(0) + b"\n"))
        for _ in range(inflated // len(chunk)):
            fh.write(compressor.compress(chunk))
        fh.write(compressor.flush())


def _hostile_corpus(root: Path) -> tuple[set[str], set[str]]:
    """A corpus with every kind of bad record; returns the good texts and the expected bad ``file:line`` sources."""
    root.mkdir()
    good: set[str] = set()
    bad: set[str] = set()
    a = root / "a.jsonl"
    lines = [
        BOM + _good(1),  # a byte order mark before the first record: accepted
        b"[" * 100_000,  # RecursionError in the parser
        _good(2),
        b'{"text": "caf\xe9"}',  # invalid UTF-8
        b'{"text": ' + b"9" * 5000 + b"}",  # ValueError: int longer than int_max_str_digits
        b"{not json",
        _good(3),
        b"\xef\xbb\xbf" + _good(4),  # a BOM not at the start of the file is not accepted
        _good(5),
    ]
    a.write_bytes(b"\n".join(lines) + b"\n")
    good |= {"good document 1", "good document 2", "good document 3", "good document 5"}
    bad |= {f"{a}:{n}" for n in (2, 4, 5, 6, 8)}

    bomb = root / "b-bomb.jsonl.gz"
    _gzip_bomb(bomb, GIB)
    good.add("good document 0")
    bad.add(f"{bomb}:2")

    corrupt = root / "c-corrupt.jsonl.gz"
    head = gzip.compress(b"".join(_good(i) + b"\n" for i in range(100, 110)))
    # A second gzip member whose deflate data opens with the invalid block type 3: zlib.error, not an OSError.
    corrupt.write_bytes(head + b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + b"\x07" + b"\x00" * 32)
    good |= {f"good document {i}" for i in range(100, 110)}
    bad.add(f"{corrupt}:11")

    text = root / "d-bom.txt"
    text.write_bytes(BOM + b"A text document that starts with a byte order mark.")
    good.add("A text document that starts with a byte order mark.")
    (root / "e-too-large.txt").write_bytes(b"word " * (4 << 20))  # 20 MiB > the 16 MiB default limit
    bad.add(str(root / "e-too-large.txt"))
    (root / "f-not-parquet.parquet").write_bytes(b"PAR1 this is not a parquet file PAR1")
    bad.add(f"{root / 'f-not-parquet.parquet'}:1")
    return good, bad


_WORKER = """
import json, sys
from lmforge.config import CleanConfig
from lmforge.data import clean
cfg = CleanConfig.model_validate(json.loads(sys.argv[1]))
result = clean.run(cfg, corpus_uri=sys.argv[2], cleaned=sys.argv[3])
print(json.dumps(result.metrics))
"""

_WRAPPER = """
import resource, subprocess, sys
proc = subprocess.run([sys.executable, "-c", *sys.argv[1:]], capture_output=True, text=True)
sys.stderr.write(proc.stderr)
sys.stdout.write(proc.stdout)
print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(proc.returncode)
"""


def _clean_in_child(cfg: dict, corpus: Path, out: Path) -> tuple[dict, int]:
    """Run the clean stage in a fresh process; its metrics and peak RSS in bytes."""
    proc = subprocess.run(
        [sys.executable, "-c", _WRAPPER, _WORKER, json.dumps(cfg), str(corpus), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    *metrics, peak = proc.stdout.strip().splitlines()
    return json.loads(metrics[-1]), int(peak.split()[1]) * 1024


def test_hostile_corpus_is_cleaned_with_every_bad_record_counted_and_bounded_memory(tmp_path):
    good, expected_bad = _hostile_corpus(tmp_path / "raw")
    cfg = {**RULES_OFF, "min_chars": 0, "min_words": 0, "max_bad_records": 100}
    out = tmp_path / "cleaned"

    metrics, peak_rss = _clean_in_child(cfg, tmp_path / "raw", out)

    logged = [json.loads(x) for x in (out / "bad_records.jsonl").read_text().splitlines()]
    sources = {b["source"] for b in logged}
    assert metrics["bad_records"] == len(logged) == len(expected_bad)
    assert sources == expected_bad
    problems = {b["source"].rsplit("/", 1)[1]: b["problem"] for b in logged}
    assert problems["a.jsonl:2"] == "not valid JSON (nested too deeply)"
    assert problems["a.jsonl:4"] == "invalid UTF-8 at byte 13"
    assert problems["b-bomb.jsonl.gz:2"] == f"line longer than {16 << 20} bytes"
    assert problems["e-too-large.txt"] == f"text file larger than {16 << 20} bytes"
    assert problems["c-corrupt.jsonl.gz:11"].startswith("cannot decompress, rest of file skipped (")

    import pyarrow.parquet as pq

    texts = {t for f in sorted(out.glob("*.parquet")) for t in pq.read_table(f, columns=["text"])["text"].to_pylist()}
    assert good <= texts
    assert peak_rss < GIB, f"peak RSS {peak_rss / 1e6:.0f} MB"
    print(f"hostile corpus with a 1 GiB gzip bomb: peak RSS {peak_rss / 1e6:.0f} MB")


def test_each_bad_line_kind_is_one_counted_record_in_the_reader(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(
        BOM
        + b"\n".join(
            [_good(1), b"[" * 100_000, b'{"a":' * 20_000, _good(2), b"x" * 300_000, b'{"text": "\xff"}', _good(3)]
        )
        + b"\n"
    )
    reader = CorpusReader(corpus, max_bad_records=10, max_record_bytes=200_000)
    docs = list(reader)
    assert [d.text for d in docs] == ["good document 1", "good document 2", "good document 3"]
    assert [d.source for d in docs] == [f"{corpus}:1", f"{corpus}:4", f"{corpus}:7"]
    assert [(b.source, b.problem) for b in reader.bad_samples] == [
        (f"{corpus}:2", "not valid JSON (nested too deeply)"),
        (f"{corpus}:3", "not valid JSON (nested too deeply)"),
        (f"{corpus}:5", "line longer than 200000 bytes"),
        (f"{corpus}:6", "invalid UTF-8 at byte 10"),
    ]


def test_a_deeply_nested_line_counts_against_max_bad_records_like_any_other(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(_good(1) + b"\n" + b"[" * 100_000 + b"\n")
    with pytest.raises(
        InputDataError, match=r"c\.jsonl:2: not valid JSON \(nested too deeply\) \(bad record 1 exceeds"
    ):
        list(CorpusReader(corpus, max_bad_records=0))


def test_max_record_bytes_is_a_validated_config_field():
    assert CleanConfig().max_record_bytes == 16 << 20
    assert "memory" in CleanConfig.model_fields["max_record_bytes"].description
    with pytest.raises(ValueError, match="max_record_bytes"):
        CleanConfig.model_validate({"max_record_bytes": 10})


def _qa(tmp_path: Path, content: bytes) -> str:
    path = tmp_path / "qa.jsonl"
    path.write_bytes(content)
    return str(path)


def test_qa_file_with_a_byte_order_mark_is_read_whole(tmp_path):
    lines = [json.dumps({"prompt": f"q{i}", "response": f"a{i}"}).encode() for i in range(3)]
    examples = load_examples(_qa(tmp_path, BOM + b"\n".join(lines) + b"\n"))
    assert [e.prompt for e in examples] == ["q0", "q1", "q2"]


@pytest.mark.parametrize(
    ("bad_line", "problem"),
    [
        (b'{"prompt": "caf\xe9", "response": "a"}', "invalid UTF-8 at byte 15"),
        (b"[" * 100_000, r"not valid JSON \(nested too deeply\)"),
        (b'{"prompt": "q", "response": "' + b"a" * 300_000 + b'"}', "line longer than 200000 bytes"),
    ],
)
def test_a_bad_qa_line_is_one_error_naming_file_and_line(tmp_path, bad_line, problem):
    ok = json.dumps({"prompt": "q", "response": "a"}).encode()
    uri = _qa(tmp_path, b"\n".join([ok, ok, bad_line, ok]) + b"\n")
    with pytest.raises(InputDataError, match=rf"^{uri}:3: {problem}"):
        load_examples(uri, max_line_bytes=200_000)


def test_a_parquet_row_over_the_record_limit_is_one_bad_record_never_turned_into_python(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    limit = 1 << 20
    path = tmp_path / "c.parquet"
    texts = ["good document 1", "a" * (2 * limit), "good document 3", "short text", "good document 5"]
    ids = ["1", "2", "3", "i" * (limit + 1), "5"]
    pq.write_table(pa.table({"id": ids, "text": texts}), path)  # one row group: 3 MiB in all
    assert path.stat().st_size < 300_000  # compressed: the file's size is no guide to a row's
    list(CorpusReader(path, max_bad_records=10, max_record_bytes=64 << 20))  # imports done, caches warm

    reader = CorpusReader(path, max_bad_records=10, max_record_bytes=limit)
    tracemalloc.start()  # Python's allocations only: Arrow's buffers are not traced, Python strings are
    try:
        docs = list(reader)
        python_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    assert [d.text for d in docs] == ["good document 1", "good document 3", "good document 5"]
    assert [(b.source, b.problem) for b in reader.bad_samples] == [
        (f"{path}:2", f"record larger than {limit} bytes ({2 * limit + 1} bytes)"),
        (f"{path}:4", f"record larger than {limit} bytes ({limit + 11} bytes)"),
    ]
    assert python_peak < limit, f"{python_peak} bytes"  # the oversized rows never became Python strings
