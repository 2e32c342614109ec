"""Which tag an image reference names: the release tag by default, the content tag when asked, the image's own
content tag inside an image (no checkout there to hash)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lmforge import __version__
from lmforge.cli import application
from lmforge.errors import ConfigError
from lmforge.run_context import PIPELINE_VERSION_ENV
from lmforge_kfp.components import images
from lmforge_kfp.components.images import (
    CONTENT,
    CONTENT_TAG_ENV,
    TAG_ENV,
    computed_tag,
    content_tag,
    image_for,
    image_tag,
    release_tag,
    service_image,
    with_tag,
)

runner = CliRunner()


@pytest.fixture
def tag_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No tag chosen by the caller's environment; whatever a test sets is undone after it."""
    for name in (TAG_ENV, CONTENT_TAG_ENV):
        monkeypatch.setenv(name, "")  # recorded, so that a value the code under test sets is removed too
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def outside_a_checkout(tag_env: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[pytest.MonkeyPatch]:
    """The package as an image holds it: no ``images/`` or ``src/`` beside it."""
    tag_env.setattr(images, "REPO_ROOT", tmp_path)
    content_tag.cache_clear()
    yield tag_env
    content_tag.cache_clear()


def test_references_name_the_release_tag_by_default(tag_env: pytest.MonkeyPatch) -> None:
    assert release_tag() == __version__.split("+")[0] == image_tag()
    assert image_for("pretrain") == f"ghcr.io/lmforge/lmforge-train:{release_tag()}"
    assert service_image("serve") == f"ghcr.io/lmforge/lmforge-serve:{release_tag()}"


def test_content_names_the_content_tag_of_this_checkout(tag_env: pytest.MonkeyPatch) -> None:
    tag_env.setenv(TAG_ENV, CONTENT)
    assert content_tag() == computed_tag() == image_tag()
    assert image_for("clean").endswith(f"/lmforge-cpu:{computed_tag()}")


def test_any_other_valid_tag_is_named_as_given(tag_env: pytest.MonkeyPatch) -> None:
    tag_env.setenv(TAG_ENV, "nightly-2026.12_02")
    assert image_for("build_tensorrt").endswith("/lmforge-tensorrt:nightly-2026.12_02")


@pytest.mark.parametrize("tag", ["-leading-dash", "with space", "a/b", "x" * 129, "tag:colon"])
def test_a_tag_that_is_no_docker_tag_is_one_config_error(tag_env: pytest.MonkeyPatch, tag: str) -> None:
    tag_env.setenv(TAG_ENV, tag)
    with pytest.raises(ConfigError, match="image tag"):
        image_for("clean")


def test_inside_an_image_the_content_tag_is_the_one_it_was_built_under(outside_a_checkout) -> None:
    outside_a_checkout.setenv(CONTENT_TAG_ENV, "0.1.0-0123456789ab")
    outside_a_checkout.setenv(TAG_ENV, CONTENT)  # as images/*/Dockerfile set it
    assert content_tag() == "0.1.0-0123456789ab"
    assert image_for("pretrain").endswith("/lmforge-train:0.1.0-0123456789ab")


def test_an_image_built_without_a_content_tag_reports_the_release_tag(outside_a_checkout) -> None:
    outside_a_checkout.setenv(CONTENT_TAG_ENV, "")  # `ARG CONTENT_TAG=` left empty
    assert content_tag() == release_tag()


def test_with_tag_retags_lmforge_image_references_only() -> None:
    assert with_tag("r.example.com:5000/ml/lmforge-cpu:0.1.0", "t1") == "r.example.com:5000/ml/lmforge-cpu:t1"
    for other in ("python:3.11", "ghcr.io/lmforge/lmforge-cpu", "see ghcr.io/lmforge/lmforge-cpu:0.1.0", "0.1.0"):
        assert with_tag(other, "t1") == other


def test_images_lists_the_references_and_tag_prints_the_content_tag(tag_env: pytest.MonkeyPatch) -> None:
    listed = runner.invoke(application(), ["images"])
    assert listed.exit_code == 0, listed.output
    assert f"train\tghcr.io/lmforge/lmforge-train:{release_tag()}\n" in listed.output
    tag_env.setenv(TAG_ENV, CONTENT)
    assert f"serve\tghcr.io/lmforge/lmforge-serve:{computed_tag()}\n" in runner.invoke(application(), ["images"]).output
    tag_env.delenv(TAG_ENV)
    assert runner.invoke(application(), ["images", "--tag"]).output == f"{computed_tag()}\n"


def test_images_with_a_bad_tag_ends_in_one_error_line(tag_env: pytest.MonkeyPatch) -> None:
    tag_env.setenv(TAG_ENV, "bad tag")
    result = runner.invoke(application(), ["images"])
    assert result.exit_code == 2 and result.output.strip().splitlines()[-1].startswith("error: image tag 'bad tag'")


def test_compile_with_a_bad_image_tag_ends_in_one_error_line_and_writes_nothing(tmp_path: Path) -> None:
    # A fresh process: component modules name their image when first imported.
    args = [sys.executable, "-m", "lmforge", "compile", "--image-tag", "bad tag", "--root", str(tmp_path)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: image tag 'bad tag'")
    assert not any(tmp_path.iterdir())


def test_a_step_reports_its_code_s_content_tag_as_the_pipeline_version(tag_env: pytest.MonkeyPatch) -> None:
    from lmforge_kfp.runtime import _context

    tag_env.setenv(PIPELINE_VERSION_ENV, "")
    tag_env.delenv(PIPELINE_VERSION_ENV)
    assert _context({"preset": "tiny-cpu"})["pipeline_version"] == computed_tag()
