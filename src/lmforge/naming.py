"""Names derived from the data: the default release name of a run, from its corpus URI."""

from __future__ import annotations

import re
import unicodedata
from pathlib import PurePosixPath

from lmforge.data.corpus import SUFFIXES
from lmforge.data.demo import is_demo

DEMO_MODEL_NAME = "lmforge-demo"  # the demo corpus's release name, and the name when none is given
FALLBACK_MODEL_NAME = "lmforge-model"
MAX_MODEL_NAME = 63  # one DNS label, so a serving object can be named after the release
_GLOB_CHARS = frozenset("*?[")
_INVALID = re.compile(r"[^a-z0-9._-]+")
_EDGES = "._-"


def default_model_name(corpus_uri: str) -> str:
    """A valid registry name (``[a-z0-9][a-z0-9._-]*``, at most 63 characters) for a model trained on ``corpus_uri``.

    The name is the corpus's last path component without glob characters, with a corpus suffix
    (``.jsonl.gz``, ``.parquet``, ...) removed, accents folded to ASCII, lowercased, and every run of other
    characters replaced by ``-``: ``s3://bucket/corpora/Support Tickets.jsonl.gz`` → ``support-tickets``,
    ``/data/wiki/*.parquet`` → ``wiki``, ``s3://bucket`` → ``bucket``. A ``demo://`` corpus keeps
    ``lmforge-demo``; a name with nothing usable left (``/``, ``语料.txt``) becomes ``lmforge-model``.
    """
    if is_demo(corpus_uri):
        return DEMO_MODEL_NAME
    path = corpus_uri.removeprefix("s3://").removeprefix("file://")
    parts = [part for part in PurePosixPath(path).parts if part != "/" and not _GLOB_CHARS & set(part)]
    if not parts:
        return FALLBACK_MODEL_NAME
    stem = parts[-1]
    suffix = next((s for s in SUFFIXES if stem.lower().endswith(s)), "")
    stem = stem[: len(stem) - len(suffix)]
    ascii_name = unicodedata.normalize("NFKD", stem).encode("ascii", "ignore").decode().lower()
    name = _INVALID.sub("-", ascii_name).strip(_EDGES)[:MAX_MODEL_NAME].rstrip(_EDGES)
    return name or FALLBACK_MODEL_NAME
