"""docs/contributing.md's walk-through, done in a copy of the repository: a throwaway ``shout`` stage joins the real
DAG through the hand-edited files the guide names (at most four), ``lmforge compile`` writes everything KFP needs,
and the DAG runs under kfp.local up to the new stage."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "contributing.md"
MAX_HAND_EDITED = 4

# The stage module, with its config model (the registry imports it from here).
STAGE_MODULE = '''
"""The ``shout`` stage: every cleaned document upper-cased, ``times`` times a line."""

from pathlib import Path

import pyarrow.parquet as pq
from pydantic import Field

from lmforge.artifacts import input_record, staged_output, write_manifest
from lmforge.config.base import StrictModel
from lmforge.results import StageResult


class ShoutConfig(StrictModel):
    """Settings of the shout stage."""

    times: int = Field(2, ge=1, description="How often each document is repeated, upper-cased.")


def run(cfg: ShoutConfig, *, cleaned: str, loud: str) -> StageResult:
    """Write every cleaned document upper-cased ``cfg.times`` times, one document a line, to ``loud``."""
    rows = [row for path in sorted(Path(cleaned).glob("*.parquet")) for row in pq.read_table(path).to_pylist()]
    with staged_output(loud) as out:
        (out / "loud.txt").write_text("\\n".join(" ".join([r["text"].upper()] * cfg.times) for r in rows))
        write_manifest(out, "loud-text", inputs={"cleaned": input_record(cleaned)}, config=cfg.model_dump())
    return StageResult(metrics={"documents": float(len(rows))})
'''

REGISTRY_IMPORT = "from lmforge.data.shout import ShoutConfig\n"
REGISTRY_ENTRY = """    StageSpec(
        name="shout",
        summary="Upper-case every cleaned document.",
        entry="lmforge.data.shout:run",
        config=ShoutConfig,
        inputs=(artifact("cleaned", "Dataset", "Cleaned corpus from clean or merge_shards."),),
        outputs=(artifact("loud", "Dataset", "The documents, upper-cased."),),
    ),
"""

STAGE_TEST = '''
"""The shout stage upper-cases every cleaned document."""

import pyarrow as pa
import pyarrow.parquet as pq

from lmforge.artifacts import write_manifest
from lmforge.data.shout import ShoutConfig, run


def test_shout_repeats_every_document_upper_cased(tmp_path):
    (tmp_path / "cleaned").mkdir()
    pq.write_table(pa.table({"text": ["to be", "or not"]}), tmp_path / "cleaned" / "part-0.parquet")
    write_manifest(tmp_path / "cleaned", "cleaned-corpus")
    run(ShoutConfig(times=2), cleaned=str(tmp_path / "cleaned"), loud=str(tmp_path / "loud"))
    assert (tmp_path / "loud" / "loud.txt").read_text() == "TO BE TO BE\\nOR NOT OR NOT"
'''

# The pipeline's edits: load the component, document the section's overrides parameter, add the task.
PIPELINE_EDITS = (
    ('serve = load_component("serve")\n', 'serve = load_component("serve")\nshout = load_component("shout")\n'),
    (
        "        model_name: Release name:",
        '        shout_overrides: JSON object of shout settings, e.g. {"times": 3}.\n        model_name: Release name:',
    ),
    (
        '    cleaned.set_display_name("1d merge cleaned shards")\n',
        '    cleaned.set_display_name("1d merge cleaned shards")\n'
        '    loud = shout(cleaned=cleaned.outputs["cleaned"], **settings("shout"))\n'
        '    loud.set_display_name("1e shout")\n',
    ),
)


def _copy_repository(target: Path) -> Path:
    """The repository's files as git sees them (tracked, and untracked unless ignored) copied to ``target``."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{path}: expected one {old!r}"
    path.write_text(text.replace(old, new), encoding="utf-8")


def _add_the_stage(repo: Path) -> None:
    """What the guide tells a contributor to write, file by file."""
    (repo / "src/lmforge/data/shout.py").write_text(STAGE_MODULE.lstrip(), encoding="utf-8")
    registry = repo / "src/lmforge/stages/registry.py"
    _edit(registry, "from lmforge.errors import", REGISTRY_IMPORT + "from lmforge.errors import")
    end_of_dag = "\n)\n\n\n_PREFLIGHT_INPUTS = ("  # the tuple of the DAG's stages ends here
    _edit(registry, end_of_dag, "\n" + REGISTRY_ENTRY.rstrip("\n") + end_of_dag)
    for old, new in PIPELINE_EDITS:
        _edit(repo / "pipelines/lmforge_pipeline.py", old, new)
    (repo / "tests/unit/data/test_data_shout.py").write_text(STAGE_TEST.lstrip(), encoding="utf-8")


def _snapshot(repo: Path) -> dict[str, str]:
    """sha256 of every file under ``repo`` by relative path (links to folders not followed)."""
    return {
        (Path(folder) / name).relative_to(repo).as_posix(): hashlib.sha256(
            (Path(folder) / name).read_bytes()
        ).hexdigest()
        for folder, _, names in os.walk(repo)
        for name in names
    }


def _changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {name for name in before.keys() | after.keys() if before.get(name) != after.get(name)}


def _importable(repo: Path) -> dict[str, str]:
    """Environment under which Python imports the copy's packages, laid out as the installed ones are."""
    for package in ("components", "pipelines"):
        link = repo / "src" / "lmforge_kfp" / package
        if not link.exists():
            link.symlink_to(repo / package, target_is_directory=True)
    return {**os.environ, "PYTHONPATH": str(repo / "src"), "PYTHONDONTWRITEBYTECODE": "1"}


def _python(repo: Path, env: dict[str, str], *args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{args}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _up_to(pipeline_yaml: Path, task: str) -> str:
    """The compiled pipeline cut down to ``task`` and the tasks it depends on (what a quick run needs)."""
    docs = list(yaml.safe_load_all(pipeline_yaml.read_text(encoding="utf-8")))
    tasks = docs[0]["root"]["dag"]["tasks"]
    keep, todo = set(), [task]
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            todo += tasks[name].get("dependentTasks", [])
    docs[0]["root"]["dag"]["tasks"] = {name: spec for name, spec in tasks.items() if name in keep}
    return yaml.safe_dump_all(docs, sort_keys=False)


def _guide_rows() -> list[tuple[str, str]]:
    """(path pattern, kind) of every row of the guide's table of files."""
    rows = [line.split("|") for line in GUIDE.read_text(encoding="utf-8").splitlines() if line.startswith("| `")]
    return [(path, row[2].strip()) for row in rows for path in row[1].split("`")[1::2]]


def _named(name: str, kind: str) -> bool:
    """Whether the guide names file ``name`` (as it names the shout stage's files) in a row of ``kind``."""
    patterns = [path.replace("<family>", "data").replace("<stage>", "shout") for path, k in _guide_rows() if k == kind]
    return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)


def test_a_new_stage_joins_the_real_dag_with_four_hand_edited_files_and_runs(tmp_path, shakespeare_docs):
    repo = _copy_repository(tmp_path / "repo")
    env = _importable(repo)
    pristine = _snapshot(repo)
    _add_the_stage(repo)
    hand_edited = _changed(pristine, _snapshot(repo))

    required = [path for path, kind in _guide_rows() if kind == "hand-edited"]
    assert len(hand_edited) == len(required) <= MAX_HAND_EDITED, (sorted(hand_edited), required)
    unnamed = sorted(name for name in hand_edited if not _named(name, "hand-edited"))
    assert not unnamed, f"the contributor wrote files the guide does not name: {unnamed}"

    before_compile = _snapshot(repo)
    _python(repo, env, "-m", "lmforge", "compile")
    generated = _changed(before_compile, _snapshot(repo))
    by_hand = sorted(name for name in generated if not _named(name, "generated"))
    assert not by_hand, f"lmforge compile wrote files the guide does not call generated: {by_hand}"
    assert "components/shout/component.yaml" in generated and "components/shout/README.md" in generated
    assert "shout_overrides" in (repo / "components/preflight/component.yaml").read_text()

    help_text = _python(repo, env, "-m", "lmforge", "stage", "shout", "--help")
    assert "times" in help_text and "loud" in help_text
    _python(repo, env, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "tests/unit/data/test_data_shout.py")

    corpus = tmp_path / "raw.jsonl"
    corpus.write_text("".join(json.dumps(doc) + "\n" for doc in shakespeare_docs[:3]))
    partial = tmp_path / "up_to_shout.yaml"
    partial.write_text(_up_to(repo / "pipelines/compiled/lmforge_pipeline.yaml", "shout"))
    params = {
        "corpus_uri": str(corpus),
        "release_root": str(tmp_path / "registry"),
        "clean_overrides": json.dumps({"language.enabled": False}),
        "shout_overrides": json.dumps({"times": 3}),
    }
    run = textwrap.dedent(
        """
        import json, sys
        from lmforge_kfp.pipelines.local_run import run_pipeline_locally
        done = run_pipeline_locally(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], console="quiet")
        print(done.output("shout", "loud"))
        """
    )
    printed = _python(repo, env, "-c", run, json.dumps(params), str(tmp_path / "runs"), str(partial))
    loud = Path(printed.strip().splitlines()[-1])
    text = (loud / "loud.txt").read_text()
    assert text and text == text.upper()
    assert json.loads((loud / "manifest.json").read_text())["config"] == {"times": 3}
