"""The serve stage on a real release (made by ``promote``): manifests written, apply skipped, Triton repository."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import yaml

from lmforge.artifacts import write_manifest
from lmforge.config import ExportConfig
from lmforge.config.base import validate_config
from lmforge.config.serve import ServeConfig
from lmforge.errors import ConfigError, InputDataError
from lmforge.export.export_onnx import run as export_onnx
from lmforge.release.promote import promote
from lmforge.serve.serve import placed
from lmforge.serve.serve import run as serve
from tests.support.crd_schema import CRDS, strict_validator
from tests.support.serve_helpers import serving

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def release(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("release")
    export_onnx(ExportConfig(), model=tiny_model_dir, onnx_model=root / "onnx")
    evaluation = root / "evaluation"
    evaluation.mkdir()
    (evaluation / "results.json").write_text(json.dumps({"passed": True, "gate": {"checks": []}}))
    write_manifest(evaluation, "evaluation")
    promote(
        model_name="lmforge-demo",
        release_root=str(root / "registry"),
        version="v1",
        artifacts={"student": tiny_model_dir, "onnx_fp32": root / "onnx"},
        evaluation_dir=evaluation,
    )
    return root / "registry" / "models" / "lmforge-demo" / "v1"


def _cfg(**fields) -> ServeConfig:
    return validate_config(ServeConfig, fields)


@pytest.fixture
def no_cluster(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))


def test_serve_stage_writes_the_lmforge_runtime_objects_and_skips_the_apply(release, tmp_path, no_cluster) -> None:
    image = "registry.example/lmforge-serve:0.1.0-abc"
    result = serve(_cfg(apply=True), release=str(release), serving=tmp_path / "serving", predictor_image=image)
    out = tmp_path / "serving"
    isvc = yaml.safe_load((out / "inferenceservice.yaml").read_text())
    runtime = yaml.safe_load((out / "servingruntime.yaml").read_text())
    assert isvc["spec"]["predictor"]["model"]["storageUri"] == str(release / "onnx_fp32")
    assert isvc["spec"]["predictor"]["model"]["runtime"] == runtime["metadata"]["name"]
    assert runtime["spec"]["containers"][0]["image"] == image
    for version in ("v0.15.2", "v0.20.0"):
        crd = CRDS / "kserve" / version / "serving.kserve.io_inferenceservices.yaml"
        assert not list(strict_validator(crd, "v1beta1").iter_errors(isvc))
    status = json.loads((out / "status.json").read_text())
    assert (status["status"], status["reason"]) == ("skipped", "no cluster")
    assert status["local_command"] == result.summary["local_command"] == f"lmforge serve {release} --port 8080"
    assert result.summary["artifact"] == "onnx_fp32" and (out / "manifest.json").is_file()


def test_the_serve_section_wins_over_what_the_pipeline_passes_and_fills_in_only_nulls(release, tmp_path) -> None:
    pool = {"pool": "h100"}
    taint = [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    given = {"predictor_image": "pipeline/serve:1", "gpu_node_selector": pool, "gpu_tolerations": taint}
    filled = placed(_cfg(device="gpu"), **given)
    assert (filled.image, filled.node_selector) == ("pipeline/serve:1", pool)
    assert [t.model_dump() for t in filled.tolerations] == [{**taint[0], "value": None}]
    own = placed(_cfg(device="gpu", image="mine:2", node_selector={"pool": "a10"}, tolerations=[]), **given)
    assert (own.image, own.node_selector, own.tolerations) == ("mine:2", {"pool": "a10"}, [])
    with pytest.raises(ConfigError, match=r"gpu_tolerations\[0\]\.operator"):
        placed(_cfg(), gpu_tolerations=[{"key": "gpu", "operator": "Sometimes"}])


def test_the_lmforge_runtime_without_a_predictor_image_fails_before_writing(release, tmp_path) -> None:
    with pytest.raises(ConfigError, match="set serve.image or pass the serve stage's predictor_image"):
        serve(_cfg(), release=str(release), serving=tmp_path / "serving")
    assert not (tmp_path / "serving").exists()


def test_a_gpu_predictor_is_placed_on_the_pipelines_gpu_pool(release, tmp_path) -> None:
    pool, taint = {"pool": "h100"}, [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    serve(
        _cfg(device="gpu"), release=str(release), serving=tmp_path / "s", gpu_node_selector=pool, gpu_tolerations=taint
    )
    predictor = yaml.safe_load((tmp_path / "s" / "inferenceservice.yaml").read_text())["spec"]["predictor"]
    assert predictor["nodeSelector"] == pool and predictor["tolerations"] == taint
    assert predictor["model"]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_the_serve_component_hands_its_dict_and_list_parameters_to_the_stage(release, tmp_path, no_cluster) -> None:
    """The component's body maps artifacts to paths and passes parameters (a dict, a list of dicts) as they are."""
    from kfp import dsl

    from lmforge_kfp.components import load_component

    serving_dir = dsl.Artifact(name="serving", uri=str(tmp_path / "serving"), metadata={})
    metrics = dsl.Metrics(name="metrics", uri=str(tmp_path / "metrics"), metadata={})
    taint = [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    load_component("serve").python_func(
        release=str(release),
        serving=serving_dir,
        metrics=metrics,
        predictor_image="",
        gpu_node_selector={"pool": "l4"},
        gpu_tolerations=taint,
        preset="tiny-cpu",
        overrides='{"device": "gpu"}',
    )
    predictor = yaml.safe_load((tmp_path / "serving" / "inferenceservice.yaml").read_text())["spec"]["predictor"]
    assert predictor["nodeSelector"] == {"pool": "l4"} and predictor["tolerations"] == taint


def test_serve_stage_with_triton_puts_the_model_repository_into_the_release(release, tmp_path) -> None:
    cfg = _cfg(device="gpu")
    serve(cfg, release=str(release), serving=tmp_path / "a")
    isvc = yaml.safe_load((tmp_path / "a" / "inferenceservice.yaml").read_text())
    assert isvc["spec"]["predictor"]["model"]["storageUri"] == str(release / "triton")
    assert (release / "triton" / "lmforge-demo" / "config.pbtxt").is_file()
    assert (release / "triton" / "lmforge-demo" / "1" / "model.onnx").is_file()
    assert not (tmp_path / "a" / "servingruntime.yaml").exists()
    serve(cfg, release=str(release), serving=tmp_path / "b")  # the same repository again: accepted
    with pytest.raises(InputDataError, match="never overwritten"):
        serve(_cfg(device="gpu", max_batch_size=4), release=str(release), serving=tmp_path / "c")


def test_the_predictor_serves_a_release_directory(release, tmp_path) -> None:
    with serving(release, tmp_path / "serve.log", {"max_tokens_limit": 8, "default_max_tokens": 8}) as server:
        resp = httpx.post(f"{server.url}/v1/models/lmforge-demo:predict", json={"instances": ["O Romeo"]}, timeout=60)
        stats = httpx.get(f"{server.url}/lmforge/v1/models/lmforge-demo/stats", timeout=10).json()
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["predictions"][0]["token_ids"]) <= 8
    assert stats["artifact"] == "onnx_fp32" and stats["served"] == str(release / "onnx_fp32")
