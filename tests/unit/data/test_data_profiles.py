"""``clean.profile``: manuals keep under ``docs`` what the web rules throw away, and preflight says why and what to
change before any training.

The man pages are laid out as ``man`` renders them (header, NAME, SYNOPSIS with ``{a|b}`` choices, option lines,
footer) around prose from the docstrings of Python's own standard library, so every page reads differently.
"""

from __future__ import annotations

import importlib
import json
import re
import textwrap
from pathlib import Path

import pytest

from lmforge.config import CleanConfig, validate_config
from lmforge.data import clean
from lmforge.data.retention import estimate
from lmforge.preflight import preflight

MODULES = ["json", "csv", "argparse", "logging", "pathlib", "textwrap", "shutil", "tempfile", "zipfile", "tarfile"]
MODULES += ["gzip", "hashlib", "base64", "struct", "datetime", "calendar", "subprocess", "socket", "selectors", "queue"]


def man_page(module: str) -> str:
    doc = " ".join((importlib.import_module(module).__doc__ or module).split())
    name = module.upper()
    prose = textwrap.fill(doc[:1500], 65, initial_indent=" " * 7, subsequent_indent=" " * 7)
    return f"""{name}(1)                 General Commands Manual                {name}(1)

NAME
       {module} - work with {module} data from the command line

SYNOPSIS
       {module} [-h] [-v] [--format {{json|text}}] [FILE]...

DESCRIPTION
{prose}

OPTIONS
       -h, --help
              display this help and exit

       -v, --verbose
              print each file's name as it is read

       --format {{json|text}}
              output format

SEE ALSO
       python3(1)

lmforge-test 1.0                  2026-12-01                     {name}(1)"""


@pytest.fixture(scope="module")
def man_corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("man") / "man.jsonl"
    path.write_text("".join(json.dumps({"id": m, "text": man_page(m)}) + "\n" for m in MODULES), encoding="utf-8")
    return path


def texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


def test_man_pages_keep_80_percent_under_docs_where_web_keeps_under_half(man_corpus, tmp_path):
    web = estimate(texts(man_corpus), CleanConfig())
    assert web.kept / web.documents < 0.5 and web.removed.most_common(1)[0][0] == ("c4", "c4_curly_bracket")
    result = clean.run(CleanConfig(profile="docs"), corpus_uri=str(man_corpus), cleaned=tmp_path / "cleaned")
    assert result.metrics["docs_out"] / result.metrics["docs_in"] >= 0.8


def test_preflight_predicts_low_retention_and_names_the_rule_the_setting_and_the_profile(man_corpus, tmp_path, caplog):
    report = preflight.run_checks(
        corpus_uri=str(man_corpus), qa_uri="demo://chatterbot", release_root=str(tmp_path / "reg"), s3_secret_name=""
    )
    assert report.predicted_retention is not None and report.predicted_retention < 0.5
    (warning,) = report.warnings
    assert warning.startswith("cleaning with clean.profile=web keeps ")
    assert "the rule removing most is c4 (c4_curly_bracket: " in warning
    assert "set by clean.c4.filter_curly_bracket=false" in warning
    kept_by_docs = re.search(r"; clean\.profile=docs keeps (\d+) of 20 sampled documents", warning)
    assert kept_by_docs and int(kept_by_docs.group(1)) >= 16
    assert any(r.levelname == "WARNING" and "c4_curly_bracket" in r.getMessage() for r in caplog.records)
    docs = preflight.run_checks(
        corpus_uri=str(man_corpus),
        qa_uri="demo://chatterbot",
        release_root=str(tmp_path / "reg"),
        s3_secret_name="",
        clean=CleanConfig(profile="docs"),
    )
    assert docs.warnings == [] and docs.predicted_retention >= 0.5


def test_an_explicit_setting_wins_over_the_profile_and_the_profile_is_recorded():
    cfg = validate_config(CleanConfig, {"profile": "docs", "c4": {"filter_curly_bracket": True}})
    assert cfg.c4.filter_curly_bracket is True and cfg.c4.min_words_per_line == 0  # the rest from docs
    assert CleanConfig.model_validate(cfg.model_dump()) == cfg
    assert CleanConfig().c4.filter_curly_bracket is True and CleanConfig().profile == "web"
    code = CleanConfig(profile="code")
    assert not code.language.enabled and not code.c4.enabled and not code.fineweb.enabled
