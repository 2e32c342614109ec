"""The docs describe the repository as it is: every path they name exists, and none narrates issue numbers."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md")), *REPO.glob("*/README.md")]
TOP_FOLDERS = ("src/", "tests/", "docs/", "bench/", "images/", "manifests/", "components/", "pipelines/", ".ci/")
# Paths a reader makes by following a doc: the contributing guide's example stage, the GPU check's record.
MADE_BY_THE_READER = {
    "src/lmforge/data/shout.py",
    "components/shout/component.yaml",
    "tests/unit/data/test_data_shout.py",
    "bench/results/gpu_check.json",
}


def _named_paths(doc: Path) -> list[str]:
    """Repository paths in a doc's inline code (``path``, ``path::test``, ``path:12``), placeholders left out."""
    paths = []
    for match in re.finditer(r"`([^`\s]+)`", doc.read_text(encoding="utf-8")):
        path = re.sub(r":\d+(-\d+)?$", "", match.group(1).split("::")[0].rstrip(".,:;)"))
        if path.startswith(TOP_FOLDERS) and not any(mark in path for mark in "<{$"):
            paths.append(path)
    return paths


def _exists(path: str, doc: Path) -> bool:
    """Whether ``path`` (a glob where it has one) names something under the repository root or the doc's folder."""
    return any(
        any(base.glob(path)) if any(ch in path for ch in "*?[") else (base / path).exists()
        for base in (REPO, doc.parent)
    )


def test_every_repository_path_the_docs_name_exists():
    missing = [
        f"{doc.relative_to(REPO)}: {path}"
        for doc in DOCS
        if doc.is_file()
        for path in _named_paths(doc)
        if path not in MADE_BY_THE_READER and not _exists(path, doc)
    ]
    assert not missing, "docs name paths that do not exist:\n" + "\n".join(missing)


def test_code_tests_and_docs_name_no_issue_numbers():
    pattern = re.compile(r"\bissue \d+", re.IGNORECASE)
    files = [
        p
        for folder in ("src", "tests", "docs", "bench", "components", "pipelines", "images", "manifests", ".ci")
        for p in (REPO / folder).rglob("*")
    ]
    hits = [
        f"{path.relative_to(REPO)}:{number}"
        for path in [*files, REPO / "README.md", REPO / "Makefile", REPO / "pyproject.toml"]
        if path.suffix in {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ""}
        and path.is_file()
        and "data" not in path.relative_to(REPO).parts
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, "history belongs in the CHANGELOG and commit log, not here:\n" + "\n".join(hits)
