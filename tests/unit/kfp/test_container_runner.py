"""What the container runner reads from the compiled pipeline and hands the release manifest (no engine needed;
tests/integration/test_containers.py runs the stages in their images)."""

from __future__ import annotations

import json

import pytest

from lmforge.errors import ConfigError
from lmforge.release.promote import stage_images
from lmforge.run_context import IMAGES_ENV
from lmforge.stages import STAGES
from lmforge_kfp.components.images import image_for
from lmforge_kfp.containers import pipeline_images
from lmforge_kfp.pipelines.local_run import COMPILED_PIPELINE


def test_every_runtime_of_the_compiled_pipeline_maps_to_the_image_its_steps_run_in() -> None:
    expected = {spec.runtime: image_for(name) for name, spec in STAGES.items()}
    assert pipeline_images(COMPILED_PIPELINE) == expected


def test_release_manifest_images_say_host_without_containers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(IMAGES_ENV, raising=False)
    assert stage_images() == {name: "host" for name in STAGES}


def test_release_manifest_images_name_each_stage_s_runtime_image(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = {"reference": "r/lmforge-cpu:t", "id": "sha256:" + "1" * 64, "digest": None}
    digest = "r/lmforge-train@sha256:" + "3" * 64
    train = {"reference": "r/lmforge-train:t", "id": "sha256:" + "2" * 64, "digest": digest}
    monkeypatch.setenv(IMAGES_ENV, json.dumps({"cpu": cpu, "train": train}))
    images = stage_images()
    assert images["clean"] == cpu and images["pretrain"] == train
    assert images["build_tensorrt"] == "host"  # a runtime the runner did not name


def test_a_malformed_images_variable_is_one_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(IMAGES_ENV, "[1, 2")
    with pytest.raises(ConfigError, match=IMAGES_ENV):
        stage_images()
