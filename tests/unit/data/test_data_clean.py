"""The corpus reader and the ``clean`` stage: rules, formats, errors and the output directory."""

from __future__ import annotations

import gzip
import json
import os
import re
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from lmforge.artifacts import read_manifest
from lmforge.config import CleanConfig
from lmforge.data import clean, clean_shard, cleaning
from lmforge.data.cleaning import Normalize
from lmforge.data.corpus import iter_documents, stable_id
from lmforge.data.rules import MinChars, MinWords
from lmforge.errors import ArtifactIncompleteError, InputDataError, WorkerLostError
from lmforge.formats.cleaned import read_cleaned
from lmforge.results import StageResult

# Rules off so each test turns on only what it checks; RULES_OFF leaves min_chars/min_words at defaults.
RULES_OFF = {
    name: {"enabled": False}
    for name in ("language", "gopher_repetition", "gopher_quality", "c4", "fineweb", "pii", "near_dedup")
}
LOOSE = {"min_chars": 0, "min_words": 0, **RULES_OFF}


def write_jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def docs(*texts: str) -> list[dict[str, str]]:
    return [{"text": t} for t in texts]


def run_clean(tmp_path: Path, corpus: Path | str, **cfg) -> tuple[StageResult, Path]:
    out = tmp_path / "cleaned"
    return clean.run(CleanConfig.model_validate({**RULES_OFF, **cfg}), corpus_uri=str(corpus), cleaned=out), out


# --- rules as units -------------------------------------------------------------------------------


def test_nfc_composes_a_decomposed_e_acute():
    assert Normalize("NFC")("caf" + "e\u0301") == "caf\u00e9"


def test_nfkc_folds_compatibility_characters():
    assert Normalize("NFKC")("\ufb01ne \u2460") == "fine 1"


def test_normalize_collapses_spaces_strips_controls_and_keeps_newlines():
    normalize = Normalize("NFC")
    assert normalize("\ufeff  a \t\t b\x00c\r\nd  \n\n  e\x07 ") == "a bc\nd\n\ne"
    assert normalize("already clean") == "already clean"
    assert normalize.changed == 1


def test_min_chars_and_min_words_count_what_they_reject():
    min_chars, min_words = MinChars(5), MinWords(3)
    assert min_chars("abcd") == "4 chars < 5"
    assert min_chars("abcde") is None
    assert min_words("two words") == "2 words < 3"
    assert min_words("now three words") is None
    assert (min_chars.removed, min_words.removed) == (1, 1)


# --- the stage on hand-made corpora ---------------------------------------------------------------


def test_stage_counts_each_rule_and_keeps_the_first_duplicate(tmp_path):
    corpus = write_jsonl(
        tmp_path / "c.jsonl",
        docs(
            "The quick brown fox jumps.",  # kept
            "the QUICK brown   fox jumps.",  # duplicate
            "The quick brown fox\tjumps.",  # duplicate
            "tiny",  # min_chars
            "onewordbutlongenoughtopass",  # min_words
            " \t\x00 ",  # empty after normalization
            "Another sentence, long enough.",  # kept
        ),
    )
    result, out = run_clean(tmp_path, corpus, min_chars=10, min_words=2)
    m = result.metrics
    assert (m["docs_in"], m["docs_out"]) == (7, 2)
    assert (m["removed_empty"], m["removed_min_chars"], m["removed_min_words"]) == (1, 1, 1)
    assert m["removed_exact_dedup"] == 2
    assert m["duplicate_rate"] == pytest.approx(2 / 7)
    assert m["bad_records"] == 0 and m["docs_per_sec"] > 0
    assert m["bytes_out"] == len(b"The quick brown fox jumps.") + len(b"Another sentence, long enough.")
    rows = list(read_cleaned(out))
    assert [r["text"] for r in rows] == ["The quick brown fox jumps.", "Another sentence, long enough."]
    assert [r["source"] for r in rows] == [f"{corpus}:1", f"{corpus}:7"]


def test_exact_dedup_ignores_case_and_whitespace_but_not_punctuation_and_keeps_the_first(tmp_path):
    corpus = write_jsonl(
        tmp_path / "c.jsonl",
        docs("Hello  World\nagain", "hello world again", "HELLO\tWORLD  AGAIN", "hello world, again"),
    )
    result, out = run_clean(tmp_path, corpus, **LOOSE)
    assert result.metrics["removed_exact_dedup"] == 2
    assert [r["text"] for r in read_cleaned(out)] == ["Hello World\nagain", "hello world, again"]


def test_exact_dedup_disabled_keeps_duplicates(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", docs("same text", "same text"))
    result, out = run_clean(tmp_path, corpus, exact_dedup=False, **LOOSE)
    assert result.metrics["removed_exact_dedup"] == 0
    assert [r["text"] for r in read_cleaned(out)] == ["same text", "same text"]


def test_output_directory_has_shards_quarantine_stats_report_and_manifest(tmp_path):
    texts = [f"document number {i} has words" for i in range(5)] + ["x", "document number 0 has words"]
    corpus = write_jsonl(tmp_path / "c.jsonl", docs(*texts))
    result, out = run_clean(tmp_path, corpus, min_chars=5, min_words=0, shard_docs=2)

    assert sorted(p.name for p in out.iterdir()) == [
        "bad_records.jsonl",
        "manifest.json",
        "part-00000.parquet",
        "part-00001.parquet",
        "part-00002.parquet",
        "quarantine.jsonl",
        "report.html",
        "stats.json",
    ]
    table = pq.read_table(out / "part-00000.parquet")
    assert table.column_names == ["id", "text", "source", "lang"]
    assert table.column("lang").to_pylist() == ["und", "und"]
    assert [pq.read_metadata(out / f"part-0000{i}.parquet").num_rows for i in range(3)] == [2, 2, 1]

    quarantine = [json.loads(line) for line in (out / "quarantine.jsonl").read_text().splitlines()]
    assert [(q["rule"], q["source"]) for q in quarantine] == [
        ("min_chars", f"{corpus}:6"),
        ("exact_dedup", f"{corpus}:7"),
    ]
    stats = json.loads((out / "stats.json").read_text())
    assert stats["removed"] == {"empty": 0, "min_chars": 1, "min_words": 0, "exact_dedup": 1, "near_dedup": 0}

    manifest = read_manifest(out, verify=True)
    assert manifest["kind"] == "cleaned-corpus"
    assert manifest["inputs"] == {"corpus": str(corpus)}
    assert manifest["config"]["shard_docs"] == 2
    assert manifest["metrics"]["docs_out"] == 5
    assert result.html is not None and result.html.startswith("<!DOCTYPE html>")
    assert "data:image/png;base64" in result.html
    assert result.html == (out / "report.html").read_text()


def test_a_quarantined_duplicate_names_the_document_kept_and_bad_records_come_last(tmp_path):
    long_text = " ".join(f"word{i}" for i in range(200))
    corpus = write_jsonl(
        tmp_path / "c.jsonl",
        [
            "{oops",
            {"id": "first", "text": "same text here"},
            {"id": "original", "text": long_text},
            {"id": "copy", "text": "Same  text HERE"},
            {"id": "edited", "text": long_text.replace("word100", "changed")},
        ],
    )
    _, out = run_clean(tmp_path, corpus, max_bad_records=1, **{**LOOSE, "near_dedup": {"enabled": True}})
    quarantine = [json.loads(line) for line in (out / "quarantine.jsonl").read_text().splitlines()]
    assert [(q["rule"], q.get("id"), q["reason"]) for q in quarantine[:2]] == [
        ("exact_dedup", "copy", "exact duplicate of first"),
        ("near_dedup", "edited", "near duplicate of original"),
    ]
    assert [(q["rule"], q["source"]) for q in quarantine[2:]] == [("bad_record", f"{corpus}:1")]


def test_quarantine_keeps_at_most_the_configured_samples_per_rule(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", docs("keep this one", *["no"] * 5, *["same text here"] * 4))
    _, out = run_clean(tmp_path, corpus, min_chars=3, min_words=0, quarantine_samples=2)
    rules = [json.loads(line)["rule"] for line in (out / "quarantine.jsonl").read_text().splitlines()]
    assert rules == ["min_chars", "min_chars", "exact_dedup", "exact_dedup"]


def test_ids_come_from_the_record_or_a_stable_hash_of_the_source(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "doc-a", "text": "first doc"}, {"text": "second doc"}])
    _, out = run_clean(tmp_path, corpus, **LOOSE)
    assert [r["id"] for r in read_cleaned(out)] == ["doc-a", stable_id(f"{corpus}:2")]


def test_text_field_is_configurable(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"body": "text lives in body"}])
    _, out = run_clean(tmp_path, corpus, text_field="body", **LOOSE)
    assert [r["text"] for r in read_cleaned(out)] == ["text lives in body"]


def test_demo_shakespeare_cleans_end_to_end(tmp_path):
    result, out = run_clean(tmp_path, "demo://shakespeare")
    m = result.metrics
    removed = sum(v for k, v in m.items() if k.startswith("removed_"))
    assert m["docs_in"] > 700 and m["docs_out"] == m["docs_in"] - removed
    first = next(read_cleaned(out))
    assert first["source"] == "demo://shakespeare:1" and len(first["id"]) == 16
    assert read_manifest(out)["inputs"] == {"corpus": "demo://shakespeare"}


# --- input formats ------------------------------------------------------------------------------------


def test_jsonl_gz_directory_and_glob_inputs_read_the_same_documents(tmp_path):
    src = tmp_path / "src"
    write_jsonl(src / "a.jsonl", docs("alpha one", "alpha two"))
    with gzip.open(src / "b.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.write(json.dumps({"text": "beta one"}) + "\n")
    (src / "sub").mkdir()
    (src / "sub" / "c.txt").write_text("gamma as a whole file\nwith two lines\n", encoding="utf-8")
    (src / "notes.md").write_text("skipped: not a corpus format", encoding="utf-8")
    (src / ".hidden.jsonl").write_text("not json, but hidden\n", encoding="utf-8")

    by_dir = [d.text for d in iter_documents(src)]
    assert by_dir == ["alpha one", "alpha two", "beta one", "gamma as a whole file\nwith two lines\n"]
    assert [d.text for d in iter_documents(src / "b.jsonl.gz")] == ["beta one"]
    assert [d.text for d in iter_documents(f"{src}/*.jsonl*")] == by_dir[:3]
    assert [d.source for d in iter_documents(f"{src}/**/*.txt")] == [f"{src}/sub/c.txt"]

    result, _ = run_clean(tmp_path, src, **LOOSE)
    assert result.metrics["docs_out"] == 4


def test_parquet_input_is_read_row_by_row(tmp_path):
    _, first = run_clean(tmp_path, write_jsonl(tmp_path / "c.jsonl", docs("one doc", "two doc")), **LOOSE)
    shard = first / "part-00000.parquet"
    assert [(d.text, d.source) for d in iter_documents(shard)] == [
        ("one doc", f"{shard}:1"),
        ("two doc", f"{shard}:2"),
    ]


# --- errors: one line naming file and line, nothing left behind ------------------------------------


def test_missing_path_raises_and_leaves_no_output(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(InputDataError, match=f"^corpus not found: {missing}$"):
        run_clean(tmp_path, missing)
    assert not (tmp_path / "cleaned").exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"", "no documents"),
        (b"\n  \n", "no documents"),
        (b'{"text": "a"}\n{"text": "b"}\n', "all 2 documents were removed by cleaning (min_chars: 2)"),
    ],
    ids=["empty-file", "blank-lines", "nothing-survives"],
)
def test_empty_corpus_raises_and_leaves_no_output(tmp_path, content, problem):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(content)
    with pytest.raises(InputDataError) as info:
        run_clean(tmp_path, corpus)
    assert str(info.value).startswith(f"corpus {corpus}: ")
    assert problem in str(info.value) and "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


@pytest.mark.parametrize(
    ("bad_line", "problem"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "expected a JSON object, got list"),
        (b'{"other": "x"}', "field 'text' missing"),
        (b'{"text": 42}', "field 'text' is not a string (got int)"),
        (b'{"text": "caf\xe9"}', "invalid UTF-8 at byte 13"),
    ],
    ids=["non-json", "non-object", "missing-text", "non-string-text", "invalid-utf8"],
)
def test_bad_record_raises_naming_file_and_line(tmp_path, bad_line, problem):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(b'{"text": "fine document here"}\n' + bad_line + b"\n")
    with pytest.raises(InputDataError) as info:
        run_clean(tmp_path, corpus)
    message = str(info.value)
    assert message.startswith(f"{corpus}:2: {problem}")
    assert "max_bad_records=0" in message and "\n" not in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_max_bad_records_tolerates_counts_and_quarantines_them(tmp_path):
    bad = ["{oops", "[]", '{"x": 1}', '{"text": null}', '{"text": 3}']
    corpus = write_jsonl(tmp_path / "c.jsonl", [*bad, {"text": "the one good document"}])
    result, out = run_clean(tmp_path, corpus, max_bad_records=5, **LOOSE)
    assert result.metrics["bad_records"] == 5 and result.metrics["docs_out"] == 1
    quarantine = [json.loads(line) for line in (out / "quarantine.jsonl").read_text().splitlines()]
    assert [q["source"] for q in quarantine if q["rule"] == "bad_record"] == [f"{corpus}:{i}" for i in range(1, 6)]

    write_jsonl(corpus, [*bad, "{again"])
    with pytest.raises(InputDataError, match=r":6: not valid JSON .*bad record 6 exceeds max_bad_records=5"):
        run_clean(tmp_path / "second", corpus, max_bad_records=5, **LOOSE)


def test_unsupported_file_type_is_refused(tmp_path):
    corpus = tmp_path / "c.csv"
    corpus.write_text("text\nhello\n")
    with pytest.raises(InputDataError, match="unsupported file type"):
        list(iter_documents(corpus))


def test_existing_output_is_not_overwritten(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", docs("some document text"))
    (tmp_path / "cleaned").mkdir()
    (tmp_path / "cleaned" / "keep.txt").write_text("precious")
    with pytest.raises(InputDataError, match="already exists and is not empty"):
        run_clean(tmp_path, corpus, **LOOSE)
    assert (tmp_path / "cleaned" / "keep.txt").read_text() == "precious"


def test_read_cleaned_refuses_a_tampered_shard(tmp_path):
    _, out = run_clean(tmp_path, write_jsonl(tmp_path / "c.jsonl", docs("a document")), **LOOSE)
    shard = out / "part-00000.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ArtifactIncompleteError, match="part-00000.parquet: sha256 mismatch"):
        list(read_cleaned(out))


@pytest.mark.s3
def test_s3_object_and_prefix_are_read_and_sources_name_the_s3_keys(s3_env, tmp_path):
    from lmforge import storage

    base = f"s3://{s3_env}/raw"
    storage.write_bytes(f"{base}/a.jsonl", b'{"text": "alpha document"}\n')
    storage.write_bytes(f"{base}/sub/b.jsonl", b'{"text": "beta document"}\n')
    assert [(d.text, d.source) for d in iter_documents(base)] == [
        ("alpha document", f"{base}/a.jsonl:1"),
        ("beta document", f"{base}/sub/b.jsonl:1"),
    ]
    assert [d.text for d in iter_documents(f"{base}/sub/b.jsonl")] == ["beta document"]
    with pytest.raises(InputDataError, match=f"^corpus not found: s3://{s3_env}/missing$"):
        run_clean(tmp_path, f"s3://{s3_env}/missing")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_demo_shakespeare_keeps_most_scenes_under_the_tiny_cpu_rules(tmp_path):
    from lmforge.stages import resolve_stage_config

    cfg = resolve_stage_config("clean", "tiny-cpu", None)
    result = clean.run(cfg, corpus_uri="demo://shakespeare", cleaned=tmp_path / "cleaned")
    m = result.metrics
    assert m["docs_out"] >= 0.9 * m["docs_in"]  # measured 737 of 769: verse passes the published rules
    assert {r["lang"] for r in read_cleaned(tmp_path / "cleaned")} == {"en"}


# --- cleaning on several processes ----------------------------------------------------------------


def test_two_worker_processes_write_the_same_shard_as_one(tmp_path):
    # every default rule but language ID (the slowest to load) and PII on, so every counter moves
    cfg = CleanConfig.model_validate({"language": {"enabled": False}})
    outputs = {}
    for workers in (1, 2):
        out = tmp_path / f"workers-{workers}"
        clean_shard.run(
            cfg.model_copy(update={"workers": workers}),
            corpus_uri="demo://shakespeare",
            shard_index=0,
            shard_count=1,
            shard=out,
        )
        outputs[workers] = out
    one, two = (read_manifest(outputs[w], verify=True)["files"] for w in (1, 2))
    assert {n: f for n, f in one.items() if n != "stats.json"} == {n: f for n, f in two.items() if n != "stats.json"}
    stats = [json.loads((outputs[w] / "stats.json").read_text()) for w in (1, 2)]
    assert stats[1]["workers"] == 2
    for st in stats:
        del st["seconds"], st["workers"]
    assert stats[0] == stats[1]
    assert stats[0]["counts"]["docs_in"] == 769 and sum(stats[0]["removed"].values()) > 0


@pytest.fixture
def cancels(monkeypatch):
    """What each ``Future.cancel`` call in this process answered (the real method, counted)."""
    from concurrent.futures import Future

    cancel = Future.cancel
    answers: list[bool] = []

    def counted_cancel(self: Future) -> bool:
        answers.append(cancel(self))
        return answers[-1]

    monkeypatch.setattr(Future, "cancel", counted_cancel)
    return answers


def test_chunks_the_pool_has_not_started_are_cleaned_here_when_the_input_ends(cancels):
    """At the input's end the stage's process takes back the pool's unstarted backlog; order and results hold."""
    cfg = CleanConfig.model_validate({"language": {"enabled": False}})
    cleaned = {}
    for workers in (1, 2):
        chunks = list(cleaning.cleaned_chunks(cfg, iter_documents("demo://shakespeare"), workers))
        cleaned[workers] = [
            (doc.key, result) for chunk, (results, _) in chunks for doc, result in zip(chunk, results, strict=True)
        ]
    assert sum(cancels) >= 1  # measured here: 3 taken back, then one the pool had begun
    assert [key for key, _ in cleaned[2]] == sorted(key for key, _ in cleaned[2])
    assert len(cleaned[2]) == 769
    for (key_1, one), (key_2, two) in zip(cleaned[1], cleaned[2], strict=True):
        assert key_1 == key_2 and len(one) == len(two)
        assert all(bool((a == b).all()) if hasattr(a, "all") else a == b for a, b in zip(one, two, strict=True))


def test_a_shard_stopped_early_drops_the_pools_backlog_instead_of_cleaning_it(cancels):
    cfg = CleanConfig.model_validate({"language": {"enabled": False}})
    chunks = cleaning.cleaned_chunks(cfg, iter_documents("demo://shakespeare"), 2)
    first, _ = next(chunks)  # as when the reader raises or a write fails while the pool has its backlog
    chunks.close()
    assert len(first) == cleaning._CHUNK_DOCS
    assert sum(cancels) >= 1  # measured here: 5 chunks dropped; the pool had taken 2 more


@pytest.mark.parametrize("noticed", [False, True], ids=["as-it-comes", "pool-broken-at-the-next-submit"])
def test_a_worker_process_that_dies_fails_the_shard_naming_the_documents_it_held(noticed, monkeypatch):
    """Whenever the pool notices the death, the error names what was lost; with ``noticed`` the next chunk is
    sent only once the executor has marked itself broken (CPython's ``_broken``), so that sending it fails: the
    race a loaded machine loses."""
    import multiprocessing
    import signal
    from concurrent.futures import ProcessPoolExecutor

    submit = ProcessPoolExecutor.submit

    def submit_once_broken(pool: ProcessPoolExecutor, *args, **kwargs):
        deadline = time.monotonic() + 30
        while not pool._broken and time.monotonic() < deadline:
            time.sleep(0.05)
        return submit(pool, *args, **kwargs)

    cfg = CleanConfig.model_validate({"language": {"enabled": False}})
    chunks = cleaning.cleaned_chunks(cfg, iter_documents("demo://shakespeare"), 2)
    first, _ = next(chunks)  # the pool's process has cleaned its first chunk and holds a backlog
    workers = multiprocessing.active_children()
    assert len(workers) == 1
    os.kill(workers[0].pid, signal.SIGKILL)  # as the kernel's OOM killer does
    if noticed:
        monkeypatch.setattr(ProcessPoolExecutor, "submit", submit_once_broken)
    with pytest.raises(
        WorkerLostError, match=r"worker process died while it held documents \S+:(\d+) to \S+:\d+ "
    ) as lost:
        list(chunks)
    held_from = re.search(r"held documents \S+:(\d+) to", str(lost.value)).group(1)
    assert int(held_from) > int(first[-1].source.rsplit(":", 1)[1])  # a chunk after the ones already used


def test_worker_count_defaults_to_the_cgroup_cpu_limit(tmp_path, monkeypatch):
    from lmforge import cpus

    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")
    assert cpus.cgroup_cpu_limit(cpu_max) == 1.5
    cpu_max.write_text("max 100000\n")
    assert cpus.cgroup_cpu_limit(cpu_max, tmp_path / "none", tmp_path / "none") is None
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: 1.5)
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cpus.available_cpus() == 2
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: None)
    assert cpus.available_cpus() == 4
