"""Container images, checked statically (no Docker daemon here): what the Dockerfiles, the bake file and the
component → image map promise each other.

A Dockerfile is read as a list of instructions (continuation lines joined, comments dropped); nothing is built.
What only a real build shows (the base image still exists, pip resolves inside it) is the CI image job's to find.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from lmforge import __version__
from lmforge.stages import RUNTIMES as RUNTIME_GPU
from lmforge.stages import STAGES
from lmforge_kfp.components.images import (
    CONTENT,
    CONTENT_TAG_ENV,
    DEFAULT_REGISTRY,
    IMAGE_SOURCES,
    SERVICE_IMAGES,
    TAG_ENV,
    computed_tag,
    image_for,
    release_tag,
    service_image,
)
from lmforge_kfp.containers import pipeline_images
from lmforge_kfp.pipelines.local_run import COMPILED_PIPELINE, local_pipeline

ROOT = Path(__file__).resolve().parents[3]
RUNTIMES = sorted({spec.runtime for spec in STAGES.values()})
# Every image built from images/<name>/Dockerfile: the steps' runtimes and the images no step runs in (the predictor).
IMAGES = sorted({*RUNTIMES, *SERVICE_IMAGES})


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def _instructions(dockerfile: Path) -> list[Instruction]:
    logical: list[str] = []
    pending = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{dockerfile}: ends inside a continued line"
    return [Instruction(*[*line.split(None, 1), ""][:2]) for line in logical if line]


def _stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    """The build stages, each from its FROM on; only ARGs (the FROM lines' build arguments) may precede the first."""
    stages: list[list[Instruction]] = []
    for ins in instructions:
        if ins.keyword.upper() == "FROM":
            stages.append([])
        if not stages:
            assert ins.keyword.upper() == "ARG", f"{ins.keyword} before the first FROM"
            continue
        stages[-1].append(ins)
    return stages


def _arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    """Every ``ARG NAME=default`` of a Dockerfile (global or of a stage): what a plain build uses."""
    defaults = {}
    for ins in instructions:
        if ins.keyword.upper() == "ARG" and "=" in ins.args:
            name, _, value = ins.args.partition("=")
            defaults[name.strip()] = value.strip()
    return defaults


def _resolve(text: str, defaults: dict[str, str]) -> str:
    """``text`` with ``${NAME}`` / ``$NAME`` replaced by the build argument's default."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: defaults.get(m.group(1), m.group(0)), text)


def _flags_and_words(args: str) -> tuple[dict[str, str], list[str]]:
    flags, words = {}, []
    for word in args.split():
        if word.startswith("--"):
            key, _, value = word[2:].partition("=")
            flags[key] = value
        else:
            words.append(word)
    return flags, words


def _dockerfile(runtime: str) -> Path:
    return ROOT / "images" / runtime / "Dockerfile"


def _dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip().rstrip("/") for line in lines if line.strip() and not line.startswith("#")]


def test_every_component_folder_is_a_registered_stage_and_every_runtime_is_known() -> None:
    folders = {p.parent.name for p in (ROOT / "components").glob("*/component.yaml")}
    assert folders, "no components found"
    assert folders == set(STAGES), (
        f"component folders without a registry entry: {sorted(folders - set(STAGES))}; "
        f"registered stages without a component: {sorted(set(STAGES) - folders)}"
    )
    assert set(RUNTIMES) <= set(RUNTIME_GPU)


def test_every_runtime_has_a_dockerfile_and_every_dockerfile_a_runtime() -> None:
    for runtime in IMAGES:
        assert _dockerfile(runtime).is_file(), f"images/{runtime}/Dockerfile missing"
    on_disk = {p.parent.name for p in (ROOT / "images").glob("*/Dockerfile")}
    assert on_disk == set(IMAGES), f"Dockerfiles no component or service uses: {sorted(on_disk - set(IMAGES))}"
    assert not set(SERVICE_IMAGES) & set(RUNTIME_GPU), "a service image is not a step runtime"


def test_the_pipeline_hands_the_serve_step_the_predictor_image_it_builds() -> None:
    """The serve image is used: the compiled pipeline passes its reference (same registry and tag) to serve."""
    compiled = (ROOT / "pipelines" / "compiled" / "lmforge_pipeline.yaml").read_text()
    assert f"constant: {service_image('serve')}" in compiled
    assert service_image("serve") == image_for("pretrain").replace("lmforge-train:", "lmforge-serve:")
    with pytest.raises(KeyError, match="not a service image"):
        service_image("cpu")


# Public bases pinned by tag alone, with the reason (said in the Dockerfile too): none other may be.
BY_TAG_ONLY = {"nvcr.io/nvidia/tensorrt:25.10-py3": "no public digest of it was at hand; docs/tensorrt.md"}


@pytest.mark.parametrize("runtime", IMAGES)
def test_base_images_come_from_a_build_argument_pinned_by_digest_with_its_tag(runtime: str) -> None:
    instructions = _instructions(_dockerfile(runtime))
    defaults = _arg_defaults(instructions)
    stage_names: set[str] = set()
    for stage in _stages(instructions):
        _, words = _flags_and_words(stage[0].args)
        if words[0] in stage_names:
            continue  # FROM an earlier stage
        if len(words) == 3 and words[1].upper() == "AS":
            stage_names.add(words[2])
        assert words[0].startswith("${"), f"{runtime}: FROM {words[0]}: the base is not a build argument"
        image = _resolve(words[0], defaults)
        assert "$" not in image, f"{runtime}: FROM {words[0]}: the build argument has no default"
        if image in BY_TAG_ONLY:
            continue
        name, _, digest = image.partition("@")
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), f"{runtime}: base {image} is not pinned by digest"
        tag = name.rpartition(":")[2] if ":" in name.split("/")[-1] else ""
        assert tag and tag != "latest" and re.search(r"\d", tag), f"{runtime}: base {image}: no version tag beside it"


def test_the_wheel_is_built_with_the_hash_locked_build_backend_pyproject_asks_for() -> None:
    from packaging.requirements import Requirement

    lock = (ROOT / "images" / "build-backend.lock").read_text()
    pins = dict(re.findall(r"^([\w-]+)==(\S+) \\\n\s+--hash=sha256:[0-9a-f]{64}$", lock, re.MULTILINE))
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    requires = [Requirement(r) for r in pyproject["build-system"]["requires"]]
    assert {r.name for r in requires} == set(pins), "images/build-backend.lock pins other packages than pyproject's"
    for requirement in requires:
        assert requirement.specifier.contains(pins[requirement.name]), f"{requirement} not met by the lock"
    for image in IMAGES:
        runs = [i.args for i in _instructions(_dockerfile(image)) if i.keyword.upper() == "RUN"]
        assert any("--require-hashes" in r and "build-backend.lock" in r for r in runs), image
        assert any("pip wheel" in r and "--no-build-isolation" in r for r in runs), image


@pytest.mark.parametrize("runtime", IMAGES)
def test_final_image_runs_as_a_non_root_numeric_user(runtime: str) -> None:
    final = _stages(_instructions(_dockerfile(runtime)))[-1]
    users = [ins.args for ins in final if ins.keyword.upper() == "USER"]
    assert users, f"{runtime}: final stage sets no USER, so it runs as root"
    user = users[-1].split(":")[0]
    # Numeric, so the kubelet can enforce runAsNonRoot without resolving names.
    assert user.isdigit() and int(user) != 0, f"{runtime}: USER {users[-1]} is not a non-root numeric uid"
    last = [ins.keyword.upper() for ins in final][-1]
    assert last == "USER", f"{runtime}: {last} after the final USER (runs as root or is misplaced)"


@pytest.mark.parametrize("runtime", IMAGES)
def test_copy_sources_exist_and_are_in_the_build_context(runtime: str) -> None:
    ignored = _dockerignore_patterns()
    copies = 0
    instructions = _instructions(_dockerfile(runtime))
    defaults = _arg_defaults(instructions)
    for ins in instructions:
        if ins.keyword.upper() not in {"COPY", "ADD"}:
            continue
        flags, words = _flags_and_words(_resolve(ins.args, defaults))
        if "from" in flags:
            continue
        for source in words[:-1]:
            copies += 1
            assert (ROOT / source).exists(), f"{runtime}: COPY {source}: no such path in the repository"
            hits = [p for p in ignored if fnmatch.fnmatch(source.rstrip("/"), p)]
            assert not hits, f"{runtime}: COPY {source} is excluded by .dockerignore ({hits})"
    assert copies, f"{runtime}: copies nothing from the repository"


@pytest.mark.parametrize("runtime", IMAGES)
def test_mounts_and_copies_from_stages_name_a_defined_stage(runtime: str) -> None:
    defined: set[str] = set()
    for stage in _stages(_instructions(_dockerfile(runtime))):
        for ins in stage[1:]:
            for source in re.findall(r"from=([\w.-]+)", ins.args):
                assert source in defined, f"{runtime}: {ins.keyword} refers to stage {source!r} not defined before it"
        _, words = _flags_and_words(stage[0].args)
        if len(words) == 3:
            defined.add(words[2])


def _bake() -> str:
    return (ROOT / "docker-bake.hcl").read_text()


def _bake_default(variable: str) -> str:
    match = re.search(rf'variable\s+"{variable}"\s*{{\s*default\s*=\s*"([^"]*)"', _bake())
    assert match, f"docker-bake.hcl: variable {variable} with a default not found"
    return match.group(1)


def _bake_targets() -> dict[str, str]:
    # A block ends at a closing brace alone on its line; "${...}" interpolations inside it are not ends.
    return {m.group(1): m.group(2) for m in re.finditer(r'target\s+"(\w+)"\s*{(.*?)\n}', _bake(), re.DOTALL)}


def test_bake_defaults_match_the_package_version_and_image_registry() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert _bake_default("VERSION") == pyproject["project"]["version"]
    assert _bake_default("REGISTRY") == DEFAULT_REGISTRY


@pytest.mark.parametrize("runtime", IMAGES)
def test_bake_target_builds_the_runtime_dockerfile_under_the_mapped_name(runtime: str) -> None:
    body = _bake_targets().get(runtime)
    assert body is not None, f"docker-bake.hcl has no target {runtime}"
    assert f'dockerfile = "images/{runtime}/Dockerfile"' in body
    # Same names as components.images.image_for: <registry>/lmforge-<runtime>:<tag>, under the content tag (TAG,
    # which `make images` sets) and the release tag (VERSION).
    tags = f'"${{REGISTRY}}/lmforge-{runtime}:${{TAG}}", "${{REGISTRY}}/lmforge-{runtime}:${{VERSION}}"'
    assert f"tags       = [{tags}]" in body
    group = re.search(r'group\s+"default"\s*{\s*targets\s*=\s*\[([^\]]*)\]', _bake())
    assert group and f'"{runtime}"' in group.group(1)


def test_ci_workflow_installs_cpu_torch_first_and_fails_on_stale_compiled_yaml() -> None:
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
    steps = [s.get("run", "") for job in workflow["jobs"].values() for s in job["steps"]]
    script = "\n".join(steps)
    order = ["torch==2.13.0", "pip install -e", "ruff check", "ruff format --check", "pytest", "lmforge compile"]
    positions = [script.find(marker) for marker in order]
    assert all(p >= 0 for p in positions), dict(zip(order, positions, strict=True))
    assert positions == sorted(positions), "CI steps out of order"
    assert "download.pytorch.org/whl/cpu" in script
    assert "git diff --exit-code" in script[positions[-1] :]


def _copy_sources(dst: Path) -> None:
    for pattern in IMAGE_SOURCES:
        for path in ROOT.glob(pattern):
            if path.is_file():
                target = dst / path.relative_to(ROOT)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(path.read_bytes())


def test_a_changed_image_source_changes_the_tag_and_a_generated_file_does_not(tmp_path: Path) -> None:
    """A rebuilt image under the same package version must not hit KFP cache entries of the old one."""
    _copy_sources(tmp_path)
    tag = computed_tag(tmp_path)
    assert tag == computed_tag(ROOT) and tag.startswith(f"{__version__}-")
    (tmp_path / "components" / "README.md").write_text("regenerated")  # generated: not an input
    assert computed_tag(tmp_path) == tag
    loop = tmp_path / "src" / "lmforge" / "train" / "loop.py"
    loop.write_text(loop.read_text() + "\n# changed\n")
    assert computed_tag(tmp_path) != tag
    dockerfile = tmp_path / "images" / "train" / "Dockerfile"
    loop.write_text(loop.read_text().removesuffix("\n# changed\n"))
    assert computed_tag(tmp_path) == tag
    dockerfile.write_text(dockerfile.read_text() + "\n# changed\n")
    assert computed_tag(tmp_path) != tag


@pytest.mark.parametrize("image", IMAGES)
def test_each_image_carries_the_content_tag_it_is_built_under_and_names_images_by_it(image: str) -> None:
    """Inside an image there is no checkout to hash: the build argument CONTENT_TAG is its content tag."""
    final = _stages(_instructions(_dockerfile(image)))[-1]
    assert Instruction("ARG", "CONTENT_TAG=") in final
    assert Instruction("ENV", f"{CONTENT_TAG_ENV}=${{CONTENT_TAG}} {TAG_ENV}={CONTENT}") in final
    assert re.search(r"^\s*CONTENT_TAG\s*=\s*TAG$", _bake_targets()["_common"], re.MULTILINE)


# Variables of the caller's environment that would override the Makefile's defaults.
_MAKE_OVERRIDES = ("REGISTRY", "IMAGES", "LOCAL_IMAGES", "PUSH", "RELEASE", "TORCH_WHEELS", "BASE_IMAGE")


def _make_dry_run(target: str, engine: str, **variables: str) -> str:
    """What ``make -n TARGET`` prints (a recursive make's commands included), continuation lines joined."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    args = [make, "-n", target, f"ENGINE={engine}", f"PYTHON={sys.executable}"]
    env = {name: value for name, value in os.environ.items() if name not in _MAKE_OVERRIDES}
    done = subprocess.run(
        args + [f"{name}={value}" for name, value in variables.items()],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.replace("\\\n", " ")


def _built_references(dry_run: str, engine: str) -> set[str]:
    """The references a dry run's builds tag: podman build's ``-t``, or the tags of the bake targets it builds."""
    if engine == "podman":
        return set(re.findall(r"\s-t (\S+)", dry_run))
    bake = re.search(r"REGISTRY=(\S+) TAG=(\S+) VERSION=(\S+) .*?docker buildx bake ([\w ]+?) --load", dry_run)
    assert bake, f"no docker buildx bake in {dry_run}"
    registry, tag, version, targets = bake.groups()
    values = {"REGISTRY": registry, "TAG": tag, "VERSION": version}
    references = set()
    for target in targets.split():
        tags = re.search(r"tags\s*=\s*\[([^\]]*)\]", _bake_targets()[target])
        assert tags, f"docker-bake.hcl: target {target} has no tags"
        references |= {_resolve(template, values) for template in re.findall(r'"([^"]+)"', tags.group(1))}
    return references


@pytest.mark.parametrize("engine", ["podman", "docker"])
def test_local_images_builds_what_a_container_run_pulls_and_what_the_committed_pipeline_names(
    engine: str, tmp_path: Path
) -> None:
    """`lmforge run --runner ENGINE` asks for the content tag's images; `make local-images` builds them (and tags
    the release tag, which the committed pipeline names), nothing built to find out."""
    built = _built_references(_make_dry_run("local-images", engine), engine)
    run_pipeline = tmp_path / "pipeline.yaml"
    run_pipeline.write_text(local_pipeline(COMPILED_PIPELINE.read_text(), engine))
    asked = set(pipeline_images(run_pipeline).values())
    assert asked == {f"{DEFAULT_REGISTRY}/lmforge-{runtime}:{computed_tag()}" for runtime in RUNTIMES}
    assert asked <= built
    committed = set(pipeline_images(COMPILED_PIPELINE).values()) | {service_image(name) for name in SERVICE_IMAGES}
    assert committed == {f"{DEFAULT_REGISTRY}/lmforge-{image}:{release_tag()}" for image in IMAGES}
    assert committed <= built


def test_a_container_run_names_every_image_of_the_pipeline_by_the_content_tag() -> None:
    """The training steps' job_image and serve's predictor_image constants move with the steps' own images."""
    text = local_pipeline(COMPILED_PIPELINE.read_text(), "podman")
    assert f":{release_tag()}\n" not in text
    assert f"constant: {DEFAULT_REGISTRY}/lmforge-serve:{computed_tag()}" in text
    assert f"constant: {DEFAULT_REGISTRY}/lmforge-train:{computed_tag()}" in text
    assert local_pipeline(COMPILED_PIPELINE.read_text(), "subprocess").count(computed_tag()) == 0


def test_make_images_builds_with_the_content_tag_as_build_argument() -> None:
    dry_run = _make_dry_run("images", "podman", IMAGES="cpu")
    assert f"--build-arg CONTENT_TAG={computed_tag()} " in dry_run
    assert f"TAG={computed_tag()} VERSION={release_tag()} " in _make_dry_run("images", "docker", IMAGES="cpu")


@pytest.mark.parametrize(
    ("engine", "variables", "pushed_tags"),
    [
        ("podman", {}, []),
        ("podman", {"PUSH": "1"}, ["content"]),
        ("docker", {"PUSH": "1", "RELEASE": "1"}, ["content", "release"]),
    ],
)
def test_make_images_pushes_the_content_tag_and_the_release_tag_only_when_asked(
    engine: str, variables: dict[str, str], pushed_tags: list[str]
) -> None:
    tags = {"content": computed_tag(), "release": release_tag()}
    registry = "registry.example.com/ml"
    dry_run = _make_dry_run("images", engine, IMAGES="cpu", REGISTRY=registry, **variables)
    pushed = re.findall(rf"{engine} push (\S+?);", dry_run)
    assert pushed == [f"{registry}/lmforge-cpu:{tags[name]}" for name in pushed_tags]
