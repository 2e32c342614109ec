"""Token shards that a stage must refuse."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from lmforge.artifacts import write_manifest

OTHER_TOKENIZER = "f" * 64


def shards_of_another_tokenizer(shards: Path, out: Path) -> Path:
    """Copy ``shards`` to ``out`` with an index that names another tokenizer (:data:`OTHER_TOKENIZER`), the
    manifest rewritten to match, as a consistent artifact of another tokenize run would be."""
    other = shutil.copytree(shards, out)
    index = json.loads((other / "index.json").read_text())
    index["tokenizer_sha256"] = OTHER_TOKENIZER
    (other / "index.json").write_text(json.dumps(index))
    write_manifest(other, "token-shards")
    return other
