"""The images' dependency locks (images/<runtime>/requirements.lock, made by `make lock`) are current, checked
without network: every direct dependency of the image is pinned, at a version pyproject.toml still allows, with
hashes; what the base image provides is not; and each Dockerfile installs exactly its lock, then lmforge alone.

A lock records in its header the `uv pip compile` command that made it; the inputs, extras and excludes named
there are what the lock is checked against, and they must be the ones the Makefile's `lock` target passes.
"""

from __future__ import annotations

import itertools
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.unit.kfp.test_images import IMAGES, _arg_defaults, _dockerfile, _instructions, _resolve, _stages

ROOT = Path(__file__).resolve().parents[3]
LOCK_IN_IMAGE = "/opt/lmforge/requirements.lock"
_HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class Lock:
    """A parsed lock: its pins (canonical name -> version) and the compile command in its header."""

    path: Path
    pins: dict[str, Version]
    command: list[str]

    def option(self, name: str) -> list[str]:
        """Every value given to ``--name`` in the header's command."""
        return [self.command[i + 1] for i, word in enumerate(self.command[:-1]) if word == name]

    def sources(self) -> list[str]:
        """The requirement sources (positional arguments) of the header's command."""
        takes_value = {"--extra", "--excludes", "--python-version", "--python-platform", "-o", "--torch-backend"}
        words = self.command[3:]  # after "uv pip compile"
        return [w for i, w in enumerate(words) if not w.startswith("-") and (i == 0 or words[i - 1] not in takes_value)]


def read_lock(path: Path) -> Lock:
    """Parse a ``uv pip compile --generate-hashes`` output; every pin must be ``==`` with at least one sha256."""
    text = path.read_text()
    header = re.search(r"^#\s+(uv pip compile .*)$", text, re.MULTILINE)
    assert header, f"{path}: no `uv pip compile` command in the header; run `make lock`"
    entries = re.sub(r"\\\n", " ", text).splitlines()
    pins = {}
    for entry in entries:
        if not entry.strip() or entry.lstrip().startswith("#"):
            continue
        requirement = Requirement(entry.split(" --hash")[0].strip())
        (spec,) = requirement.specifier
        assert spec.operator == "==", f"{path}: {entry.split()[0]} is not pinned with =="
        assert _HASH.search(entry), f"{path}: {requirement.name} has no sha256 hash"
        pins[canonicalize_name(requirement.name)] = Version(spec.version)
    return Lock(path, pins, shlex.split(header.group(1)))


def _requirements_file(path: Path) -> list[Requirement]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def _marker_env(lock: Lock) -> dict[str, str]:
    (python,) = lock.option("--python-version")
    linux = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix"}
    return {"python_version": python, "python_full_version": f"{python}.0", "extra": "", **linux}


def lock_problems(lock: Lock, pyproject: dict[str, Any], root: Path = ROOT) -> list[str]:
    """Why ``lock`` is not current for ``pyproject`` and the inputs its header names (empty when it is)."""
    project = pyproject["project"]
    wanted = [(Requirement(r), "pyproject.toml") for r in project["dependencies"]]
    for extra in lock.option("--extra"):
        if extra not in project.get("optional-dependencies", {}):
            return [f"{lock.path.name}: extra {extra!r} is not in pyproject.toml"]
        wanted += [(Requirement(r), f"pyproject.toml [{extra}]") for r in project["optional-dependencies"][extra]]
    for source in lock.sources():
        if source != "pyproject.toml":
            wanted += [(r, source) for r in _requirements_file(root / source)]
    excluded = {
        canonicalize_name(r.name) for file in lock.option("--excludes") for r in _requirements_file(root / file)
    }
    problems = []
    env = _marker_env(lock)
    for requirement, origin in wanted:
        name = canonicalize_name(requirement.name)
        if name in excluded or (requirement.marker is not None and not requirement.marker.evaluate(env)):
            continue
        if name not in lock.pins:
            problems.append(f"{requirement.name}: {origin} requires {requirement}, not pinned in {lock.path.name}")
        elif not requirement.specifier.contains(lock.pins[name], prereleases=True):
            problems.append(
                f"{requirement.name}: {lock.path.name} pins {lock.pins[name]}, {origin} wants {requirement}"
            )
    problems += [
        f"{name}: the base image provides it, yet {lock.path.name} pins it" for name in excluded & set(lock.pins)
    ]
    return problems


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _lock(runtime: str) -> Lock:
    path = ROOT / "images" / runtime / "requirements.lock"
    assert path.is_file(), f"images/{runtime}/requirements.lock missing; run `make lock`"
    return read_lock(path)


def _make_lock_args(runtime: str) -> list[str]:
    makefile = (ROOT / "Makefile").read_text()
    match = re.search(rf"^LOCK_{runtime}\s*:=(.*)$", makefile, re.MULTILINE)
    assert match, f"Makefile: no LOCK_{runtime} (the `lock` target's arguments for images/{runtime})"
    return shlex.split(match.group(1))


@pytest.mark.parametrize("runtime", IMAGES)
def test_each_lock_pins_every_direct_dependency_of_its_image_with_hashes(runtime: str) -> None:
    lock = _lock(runtime)
    assert lock_problems(lock, _pyproject()) == [], "run `make lock`"
    assert lock.sources() == ["pyproject.toml", f"images/{runtime}/requirements.in"]
    assert lock.option("--excludes") == [f"images/{runtime}/excludes.txt"]


@pytest.mark.parametrize("runtime", IMAGES)
def test_each_lock_was_made_with_the_extras_python_and_platform_make_lock_passes(runtime: str) -> None:
    lock, make = _lock(runtime), _make_lock_args(runtime)
    for option in ("--extra", "--python-version", "--python-platform"):
        wanted = [make[i + 1] for i, word in enumerate(make[:-1]) if word == option]
        assert lock.option(option) == wanted, f"{lock.path.name}: {option} differs from the Makefile; run `make lock`"
    assert re.search(rf"^lock:.*\block-{runtime}\b", (ROOT / "Makefile").read_text(), re.MULTILINE)


def test_the_cpu_image_locks_torch_s_cpu_build_and_the_gpu_images_never_the_cpu_one() -> None:
    assert str(_lock("cpu").pins["torch"]).endswith("+cpu")
    assert str(_lock("serve").pins["torch"]).endswith("+cpu")
    assert "kserve" in _lock("serve").pins and "kserve" not in _lock("cpu").pins  # only the predictor needs it
    assert "torch" not in _lock("train").pins  # the NGC PyTorch base image's CUDA build
    assert _lock("tensorrt").pins["torch"].local is None  # PyPI's CUDA build
    assert "tensorrt" not in _lock("tensorrt").pins  # the NGC TensorRT base image's


def test_the_image_evaluate_runs_in_locks_lm_evaluation_harness() -> None:
    """evaluate runs the harness tasks (lmforge.evaluate.harness) in its image; without lm-eval there they are only
    skipped with a log line, so the lock must pin it."""
    from lmforge.stages.registry import get_stage

    runtime = get_stage("evaluate").runtime
    assert "harness" in _make_lock_args(runtime), f"Makefile: LOCK_{runtime} lacks --extra harness"
    assert "lm-eval" in _lock(runtime).pins, f"images/{runtime}/requirements.lock: no lm-eval; run `make lock`"


def test_a_dependency_added_or_raised_in_pyproject_without_relocking_is_reported() -> None:
    lock, pyproject = _lock("cpu"), _pyproject()
    assert "numpy" in lock.pins
    project = pyproject["project"]
    project["dependencies"] = [d for d in project["dependencies"] if not d.startswith("numpy")]
    project["dependencies"] += ["numpy>=999", "a-new-dependency>=1"]
    project["optional-dependencies"]["demo"] = [*project["optional-dependencies"]["demo"], "another-one"]
    problems = lock_problems(lock, pyproject)
    assert len(problems) == 3, problems
    assert any(p.startswith(f"numpy: requirements.lock pins {lock.pins['numpy']}") for p in problems)
    assert any(p.startswith("a-new-dependency: pyproject.toml requires") for p in problems)
    assert any(p.startswith("another-one: pyproject.toml [demo] requires") for p in problems)


def test_a_package_the_base_image_provides_is_reported_when_pinned(tmp_path: Path) -> None:
    (tmp_path / "images" / "x").mkdir(parents=True)
    (tmp_path / "images" / "x" / "requirements.in").write_text("# nothing\n")
    (tmp_path / "images" / "x" / "excludes.txt").write_text("torch\n")
    lock = Lock(
        tmp_path / "requirements.lock",
        {**_lock("cpu").pins},
        shlex.split(
            "uv pip compile pyproject.toml images/x/requirements.in --excludes images/x/excludes.txt "
            "--extra demo --python-version 3.11"
        ),
    )
    assert lock_problems(lock, _pyproject(), root=tmp_path) == [
        "torch: the base image provides it, yet requirements.lock pins it"
    ]


def _pip_installs(runtime: str) -> list[list[str]]:
    """The ``pip install`` commands of the final stage's RUN instructions, as argument lists after ``install``."""
    final = _stages(_instructions(_dockerfile(runtime)))[-1]
    installs = []
    for ins in final:
        if ins.keyword.upper() != "RUN":
            continue
        for command in re.split(r"&&|;", ins.args):
            words = shlex.split(command)
            if "pip" in words and "install" in words:
                installs.append(words[words.index("install") + 1 :])
    return installs


@pytest.mark.parametrize("runtime", IMAGES)
def test_each_image_installs_its_lock_with_hashes_then_lmforge_without_dependencies(runtime: str) -> None:
    instructions = _instructions(_dockerfile(runtime))
    defaults = _arg_defaults(instructions)
    final = _stages(instructions)[-1]
    copied = {}  # in the image -> in the repository
    for ins in final:
        words = _resolve(ins.args, defaults).split()
        if ins.keyword.upper() == "COPY" and not words[0].startswith("--from"):
            copied[words[-1]] = words[0]
    *locked, lmforge = _pip_installs(runtime)
    assert locked, f"{runtime}: installs no lock"
    lock_files = []
    for install in locked:
        assert {"--require-hashes", "--no-deps"} <= set(install), f"{runtime}: pip install {install} unchecked"
        options = dict(itertools.pairwise(install))
        lock_files.append(options["-r"])
        rest = [w for w in install if w not in ("--require-hashes", "--no-deps", "-r", options["-r"])]
        # the only other words: the torch source's build arguments, ${TORCH_FIND_LINKS:+--find-links "$...."}
        assert all("TORCH_" in w for w in rest), f"{runtime}: pip install {install}: more than the lock"
    own = f"images/{runtime}/requirements.lock"
    assert any(copied.get(f) == own for f in lock_files), f"{runtime}: does not install {own} ({lock_files})"
    torch_index = defaults.get("TORCH_INDEX_URL", "")
    cpu_torch = runtime in ("cpu", "serve")  # torch's CPU build
    assert torch_index == ("https://download.pytorch.org/whl/cpu" if cpu_torch else "")
    assert lmforge == ["--no-deps", "/tmp/lmforge-wheels/lmforge-*.whl"]  # no extras: their packages are locked


def test_the_cpu_and_serve_images_share_what_their_locks_pin_alike() -> None:
    """images/shared_requirements.py: the first install step of both, the layer the two images share."""
    import subprocess
    import sys

    locks = [ROOT / "images" / name / "requirements.lock" for name in ("cpu", "serve")]
    shared = subprocess.run(
        [sys.executable, str(ROOT / "images" / "shared_requirements.py"), *map(str, locks)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    texts = [re.sub(r"\s*\\\n\s*", " ", lock.read_text()) for lock in locks]
    for entry in shared:
        assert all(entry in text for text in texts), f"{entry[:60]}... not pinned alike in both locks"
    names = {Requirement(entry.split(" --hash")[0]).name for entry in shared}
    assert {"torch", "transformers", "kfp"} <= names
    only_cpu = set(read_lock(locks[0]).pins) - names
    assert only_cpu and only_cpu <= set(read_lock(locks[0]).pins)
