"""What each ``clean.profile`` keeps of four kinds of text that Debian and PyPI packages ship (the table in
docs/your-data.md); writes ``bench/results/clean_profiles.json``.

The samples: 60 man pages of ``/usr/share/man/man1`` (seeded choice) rendered with ``MANWIDTH=80 man -l | col -bx``;
``pydoc`` text of 40 standard-library modules; the ``.py`` files of ``click`` and ``requests`` over 300 bytes;
200 conversations of ``chatterbot-corpus`` as ``User:``/``Agent:`` lines. Each is cleaned by the per-document
rules of every profile (:func:`lmforge.data.retention.estimate`, what preflight predicts; no deduplication).

Run: ``python -m bench.profiles_bench``.
"""

from __future__ import annotations

import importlib
import pathlib
import pydoc
import random
import subprocess
from collections.abc import Callable

import yaml

from bench.common import write_results
from lmforge.config import CleanConfig
from lmforge.data.retention import PROFILES, estimate

PYDOC_MODULES = [
    "json",
    "csv",
    "argparse",
    "logging",
    "pathlib",
    "itertools",
    "functools",
    "collections",
    "heapq",
    "bisect",
    "random",
    "statistics",
    "textwrap",
    "string",
    "re",
    "shutil",
    "tempfile",
    "glob",
    "fnmatch",
    "zipfile",
    "tarfile",
    "gzip",
    "hashlib",
    "hmac",
    "secrets",
    "base64",
    "binascii",
    "struct",
    "codecs",
    "datetime",
    "calendar",
    "time",
    "sched",
    "queue",
    "threading",
    "subprocess",
    "socket",
    "selectors",
    "email",
    "mimetypes",
]


def man_pages(count: int = 60) -> list[str]:
    pages = sorted(pathlib.Path("/usr/share/man/man1").glob("*.1.gz"))
    random.Random(0).shuffle(pages)
    out: list[str] = []
    for page in pages:
        if len(out) == count:
            break
        shown = subprocess.run(
            f"MANWIDTH=80 man -l '{page}' 2>/dev/null | col -bx", shell=True, capture_output=True, text=True
        ).stdout.strip()
        if len(shown) > 200:
            out.append(shown)
    return out


def python_docs() -> list[str]:
    return [pydoc.render_doc(importlib.import_module(m), renderer=pydoc.plaintext)[:30_000] for m in PYDOC_MODULES]


def python_source() -> list[str]:
    files = []
    for package in ("click", "requests"):
        files += sorted(pathlib.Path(importlib.import_module(package).__file__).parent.glob("*.py"))
    return [f.read_text(encoding="utf-8") for f in files if f.stat().st_size > 300]


def conversations(count: int = 200) -> list[str]:
    import chatterbot_corpus

    root = pathlib.Path(chatterbot_corpus.__file__).parent / "data" / "english"
    out = []
    for path in sorted(root.glob("*.yml")):
        for turns in yaml.safe_load(path.read_text(encoding="utf-8")).get("conversations") or []:
            out.append("\n".join(("User: " if i % 2 == 0 else "Agent: ") + str(t) for i, t in enumerate(turns)))
    random.Random(0).shuffle(out)
    return out[:count]


SAMPLES: dict[str, Callable[[], list[str]]] = {
    "man pages": man_pages,
    "Python docs (pydoc)": python_docs,
    "Python source": python_source,
    "chat": conversations,
}


def main() -> None:
    rows = {}
    for kind, make in SAMPLES.items():
        texts = make()
        rows[kind] = {}
        for profile in PROFILES:
            got = estimate(texts, CleanConfig(profile=profile))
            rows[kind][profile] = {
                "documents": got.documents,
                "kept": got.kept,
                "bytes_kept": got.bytes_out / max(got.bytes_in, 1),
                "removed": {f"{rule} {why}": n for (rule, why), n in got.removed.most_common()},
            }
            print(f"{kind:22} {profile:5} {got.summary()}; removed {dict(got.removed.most_common(3))}")
    print(write_results("clean_profiles", {"samples": rows}))


if __name__ == "__main__":
    main()
