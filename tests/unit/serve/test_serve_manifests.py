"""KServe objects and the Triton model repository for a release, checked against the real schemas.

The InferenceService validates strictly (unknown fields are errors, as with ``fieldValidation=Strict``) against the
CRDs of KServe v0.15.2 and v0.20.0 (tests/data/crds/kserve/); ``config.pbtxt`` is parsed by Triton's own
``ModelConfig`` protobuf (``tritonclient``), which rejects any field Triton does not define.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml
from google.protobuf import text_format

from lmforge.config import ExportConfig
from lmforge.config.base import validate_config
from lmforge.config.serve import ServeConfig
from lmforge.errors import ConfigError, InputDataError
from lmforge.export.export_onnx import run as export_onnx
from lmforge.onnx_runtime import NO_PAST_FILE, WITH_PAST_FILE
from lmforge.serve.manifests import (
    HUGGINGFACE_FORMAT,
    HUGGINGFACE_RUNTIME,
    LMFORGE_FORMAT,
    LMFORGE_RUNTIME,
    TRITON_FORMAT,
    TRITON_RUNTIME,
    build_inference_service,
    build_serving_runtime,
    graph_signature,
    huggingface_args,
    served_artifact,
    write_triton_repository,
)
from tests.support.crd_schema import CRDS, strict_validator
from tests.support.pod_security import restricted_violations
from tests.support.pods import predictor_pod, serving_runtime_pod

KSERVE = CRDS / "kserve"
VERSIONS = ("v0.15.2", "v0.20.0")
STORAGE = "s3://lmforge/releases/models/lmforge-demo/v20261201-120000/int8_dynamic"
RELEASE = {"version": "v1", "artifacts": {"student": {}, "onnx_fp32": {}, "int8_dynamic": {}, "engine": {}}}


def _triton_model_config_module():
    """Triton's own ModelConfig messages, loaded from tritonclient's generated file alone: importing the
    ``tritonclient.grpc`` package registers its gRPC service protos too, whose ``inference.*`` names collide in
    protobuf's default pool with the KServe v2 protos that kserve's server registers in the same process."""
    spec = importlib.util.find_spec("tritonclient")
    path = Path(spec.submodule_search_locations[0]) / "grpc" / "model_config_pb2.py"
    loaded = importlib.util.spec_from_file_location("triton_model_config_pb2", path)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


model_config_pb2 = _triton_model_config_module()


def _validate(obj: dict, version: str) -> None:
    validator = strict_validator(KSERVE / version / "serving.kserve.io_inferenceservices.yaml", "v1beta1")
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    assert not errors, [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]


def _cfg(**fields) -> ServeConfig:
    return validate_config(ServeConfig, fields)


@pytest.mark.parametrize("version", VERSIONS)
def test_cpu_lmforge_inference_service_validates_strictly(version: str) -> None:
    isvc = build_inference_service(
        _cfg(namespace="team-a", service_account="lmforge-serve", scale_target=4, max_replicas=3),
        storage_uri=STORAGE,
        model_name="lmforge-demo",
        version="v20261201-120000",
    )
    _validate(isvc, version)
    predictor = isvc["spec"]["predictor"]
    assert predictor["model"]["runtime"] == LMFORGE_RUNTIME and predictor["model"]["storageUri"] == STORAGE
    assert (predictor["minReplicas"], predictor["maxReplicas"], predictor["scaleTarget"]) == (1, 3, 4)
    assert "nvidia.com/gpu" not in predictor["model"]["resources"].get("limits", {})
    assert "nodeSelector" not in predictor and "tolerations" not in predictor
    assert isvc["metadata"] | {} == {
        "name": "lmforge-demo",
        "namespace": "team-a",
        "labels": {
            "app.kubernetes.io/part-of": "lmforge",
            "lmforge.io/model": "lmforge-demo",
            "lmforge.io/version": "v20261201-120000",
        },
    }


@pytest.mark.parametrize("version", VERSIONS)
def test_gpu_triton_inference_service_is_placed_on_the_gpu_pool(version: str) -> None:
    cfg = _cfg(device="gpu", gpu_count=2, node_selector={"pool": "a100"})
    isvc = build_inference_service(cfg, storage_uri="s3://b/triton", model_name="lmforge-demo")
    _validate(isvc, version)
    predictor = isvc["spec"]["predictor"]
    assert predictor["model"]["runtime"] == TRITON_RUNTIME and predictor["model"]["protocolVersion"] == "v2"
    assert predictor["model"]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert predictor["nodeSelector"] == {"pool": "a100"}
    assert predictor["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


@pytest.mark.parametrize("version", VERSIONS)
def test_canary_inference_service_sends_its_share_to_the_new_release(version: str) -> None:
    isvc = build_inference_service(_cfg(canary_traffic_percent=10), storage_uri=STORAGE, model_name="m")
    _validate(isvc, version)
    assert isvc["spec"]["predictor"]["canaryTrafficPercent"] == 10


@pytest.mark.parametrize("version", VERSIONS)
def test_cpu_huggingface_inference_service_runs_the_transformers_backend_in_float32(version: str) -> None:
    cfg = _cfg(runtime="huggingface")
    args = huggingface_args(cfg, model_name="lmforge-demo", max_model_len=256)
    isvc = build_inference_service(cfg, storage_uri="s3://b/student", model_name="lmforge-demo", args=args)
    _validate(isvc, version)
    model = isvc["spec"]["predictor"]["model"]
    assert (model["runtime"], model["modelFormat"], model["storageUri"]) == (
        HUGGINGFACE_RUNTIME,
        HUGGINGFACE_FORMAT,
        "s3://b/student",
    )
    assert model["args"] == [
        "--model_name=lmforge-demo",
        "--max_model_len=256",
        "--dtype=float32",
        "--backend=huggingface",
        "--task=text_generation",
    ]
    assert "nvidia.com/gpu" not in model["resources"].get("limits", {})
    assert "nodeSelector" not in isvc["spec"]["predictor"]


@pytest.mark.parametrize("version", VERSIONS)
def test_gpu_huggingface_inference_service_runs_vllm_on_the_gpu_pool(version: str) -> None:
    cfg = _cfg(runtime="huggingface", device="gpu", hf_dtype="bfloat16", hf_gpu_memory_utilization=0.5)
    args = huggingface_args(cfg, model_name="m", max_model_len=1024)
    isvc = build_inference_service(cfg, storage_uri="s3://b/student", model_name="lmforge-demo", args=args)
    _validate(isvc, version)
    predictor = isvc["spec"]["predictor"]
    assert predictor["model"]["args"] == [
        "--model_name=m",
        "--max_model_len=1024",
        "--dtype=bfloat16",
        "--backend=vllm",
        "--gpu-memory-utilization=0.5",
    ]
    assert predictor["model"]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert predictor["nodeSelector"] == {"lmforge.io/pool": "gpu"}
    assert predictor["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_huggingface_half_precision_on_cpu_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="hf_dtype float16 needs device gpu"):
        _cfg(runtime="huggingface", hf_dtype="float16")
    assert _cfg(runtime="huggingface", device="gpu", hf_dtype="float16").hf_dtype == "float16"
    assert _cfg(runtime="lmforge", hf_dtype="float16").resolved_runtime == "lmforge"  # ignored there


def test_the_stock_huggingface_runtime_serves_the_format_and_protocol_the_service_asks_for() -> None:
    runtime = yaml.safe_load((KSERVE / "v0.20.0" / "kserve-huggingfaceserver.yaml").read_text())
    assert runtime["metadata"]["name"] == HUGGINGFACE_RUNTIME
    formats = {(f["name"], f.get("version")) for f in runtime["spec"]["supportedModelFormats"]}
    assert (HUGGINGFACE_FORMAT["name"], HUGGINGFACE_FORMAT["version"]) in formats
    isvc = build_inference_service(_cfg(runtime="huggingface"), storage_uri=STORAGE, model_name="m")
    assert isvc["spec"]["predictor"]["model"]["protocolVersion"] in runtime["spec"]["protocolVersions"]


def test_an_unknown_field_fails_the_strict_validation() -> None:
    isvc = build_inference_service(_cfg(), storage_uri=STORAGE, model_name="m")
    isvc["spec"]["predictor"]["model"]["replicas"] = 2
    with pytest.raises(AssertionError, match="replicas"):
        _validate(isvc, "v0.20.0")


@pytest.mark.parametrize("version", VERSIONS)
def test_the_stock_triton_runtime_serves_the_format_and_protocol_the_service_asks_for(version: str) -> None:
    runtime = yaml.safe_load((KSERVE / version / "kserve-tritonserver.yaml").read_text())
    assert runtime["metadata"]["name"] == TRITON_RUNTIME
    formats = {(f["name"], f.get("version")) for f in runtime["spec"]["supportedModelFormats"]}
    assert (TRITON_FORMAT["name"], TRITON_FORMAT["version"]) in formats
    assert "v2" in runtime["spec"]["protocolVersions"]


def test_lmforge_serving_runtime_validates_and_runs_the_predictor_entry_point() -> None:
    runtime = build_serving_runtime(_cfg(image="registry.example/lmforge-serve:1", max_batch_size=4))
    crd = KSERVE / "v0.20.0" / "serving.kserve.io_clusterservingruntimes.yaml"
    errors = list(strict_validator(crd, "v1alpha1").iter_errors(runtime))
    assert not errors, [e.message for e in errors]
    (fmt,) = runtime["spec"]["supportedModelFormats"]
    assert (fmt["name"], fmt["version"]) == (LMFORGE_FORMAT["name"], LMFORGE_FORMAT["version"])
    (container,) = runtime["spec"]["containers"]
    assert container["command"] == ["python", "-m", "lmforge.serve"]
    assert container["args"][:2] == ["/mnt/models", "--host"] and '"max_batch_size":4' in container["args"][-1]


def test_a_serving_runtime_without_an_image_is_refused_naming_where_to_set_it() -> None:
    with pytest.raises(ConfigError, match="set serve.image"):
        build_serving_runtime(_cfg())


def test_served_artifact_prefers_int8_on_cpu_and_the_engine_for_triton() -> None:
    assert served_artifact(RELEASE, _cfg()) == "int8_dynamic"
    assert served_artifact(RELEASE, _cfg(prefer_int8=False)) == "onnx_fp32"
    assert served_artifact(RELEASE, _cfg(device="gpu")) == "engine"
    assert served_artifact({"artifacts": {"onnx_fp32": {}}}, _cfg(device="gpu")) == "onnx_fp32"
    assert served_artifact(RELEASE, _cfg(runtime="huggingface", device="gpu")) == "student"
    with pytest.raises(
        InputDataError, match=r"nothing for the huggingface runtime to serve \(needs one of \['student'\]"
    ):
        served_artifact({"version": "v1", "artifacts": {"onnx_fp32": {}}}, _cfg(runtime="huggingface"))
    with pytest.raises(InputDataError, match="nothing for the lmforge runtime"):
        served_artifact({"version": "v1", "artifacts": {"student": {}}}, _cfg())


def test_service_name_must_be_derivable() -> None:
    with pytest.raises(ConfigError, match="set serve.service_name"):
        build_inference_service(_cfg(), storage_uri=STORAGE, model_name="9lives")


@pytest.fixture(scope="module")
def onnx_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("triton") / "onnx"
    export_onnx(ExportConfig(), model=tiny_model_dir, onnx_model=out)
    return out


def _parse(folder: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse((folder / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


@pytest.mark.slow
def test_triton_onnx_repository_parses_with_tritons_protobuf_and_matches_the_graph(onnx_dir, tmp_path) -> None:
    cfg = _cfg(device="gpu", max_batch_size=8, max_wait_ms=2.5)
    folder = write_triton_repository(
        tmp_path / "repo",
        model_name="lmforge-demo",
        model_file=onnx_dir / NO_PAST_FILE,
        platform="onnxruntime_onnx",
        cfg=cfg,
    )
    assert (folder / "1" / "model.onnx").is_file()  # Triton's file name
    config = _parse(folder)
    assert (config.name, config.platform, config.max_batch_size) == ("lmforge-demo", "onnxruntime_onnx", 8)
    assert list(config.dynamic_batching.preferred_batch_size) == [4, 8]
    assert config.dynamic_batching.max_queue_delay_microseconds == 2500
    assert config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    inputs, outputs = graph_signature(onnx_dir / NO_PAST_FILE)
    assert [(i.name, list(i.dims)) for i in config.input] == [
        ("input_ids", [-1]),
        ("attention_mask", [-1]),
        ("position_ids", [-1]),
    ]
    assert [(t.name, tuple(t.dims)) for t in config.input] == [(t.name, t.dims[1:]) for t in inputs]
    assert [(t.name, tuple(t.dims)) for t in config.output] == [(t.name, t.dims[1:]) for t in outputs]
    assert all(t.data_type == model_config_pb2.TYPE_INT64 for t in config.input)
    assert config.output[0].name == "logits" and config.output[0].data_type == model_config_pb2.TYPE_FP32


@pytest.mark.slow
def test_triton_engine_repository_takes_its_tensors_from_the_source_graph(onnx_dir, tmp_path) -> None:
    plan = tmp_path / "engine.plan"
    plan.write_bytes(b"stands in for the engine bytes; the writer only copies it")
    cfg = _cfg(device="gpu", max_batch_size=4)
    graph = onnx_dir / WITH_PAST_FILE
    folder = write_triton_repository(
        tmp_path / "repo", model_name="m", model_file=plan, platform="tensorrt_plan", cfg=cfg, signature_onnx=graph
    )
    assert (folder / "1" / "model.plan").read_bytes() == plan.read_bytes()
    config = _parse(folder)
    assert config.platform == "tensorrt_plan" and list(config.dynamic_batching.preferred_batch_size) == [4]
    names = [t.name for t in config.input]
    assert names[:3] == ["input_ids", "attention_mask", "position_ids"] and names[3] == "past_key_values.0.key"
    past = next(t for t in config.input if t.name == "past_key_values.0.key")
    assert list(past.dims)[1] == -1 and all(d > 0 for d in (past.dims[0], past.dims[2]))  # heads, past, head_dim
    assert [t.name for t in config.output][:2] == ["logits", "present.0.key"]
    with pytest.raises(ConfigError, match="signature_onnx"):
        write_triton_repository(tmp_path / "r2", model_name="m", model_file=plan, platform="tensorrt_plan", cfg=cfg)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"device": "gpu"},
        {"runtime": "triton", "device": "gpu"},
        {"runtime": "huggingface"},
        {"runtime": "huggingface", "device": "gpu"},
    ],
    ids=str,
)
def test_predictor_pods_meet_pod_security_restricted_and_mount_no_api_token(version: str, fields: dict) -> None:
    """The predictor pod KServe makes of the InferenceService and its runtime (lmforge's ServingRuntime, or the
    stock Triton or Hugging Face one) passes the ``restricted`` checks (tests/support/pod_security.py); the
    InferenceService alone passes them too, whatever the runtime adds, and still validates strictly."""
    cfg = _cfg(image="registry.example/lmforge-serve:1", service_account="lmforge-serve", **fields)
    isvc = build_inference_service(cfg, storage_uri=STORAGE, model_name="lmforge-demo")
    _validate(isvc, version)
    if cfg.resolved_runtime == "triton":
        runtime = yaml.safe_load((KSERVE / version / "kserve-tritonserver.yaml").read_text())
    elif cfg.resolved_runtime == "huggingface":  # copied from v0.20.0 only
        runtime = yaml.safe_load((KSERVE / "v0.20.0" / "kserve-huggingfaceserver.yaml").read_text())
    else:
        runtime = build_serving_runtime(cfg)
    assert restricted_violations(predictor_pod(isvc)) == []
    assert restricted_violations(predictor_pod(isvc, runtime)) == []
    assert isvc["spec"]["predictor"]["automountServiceAccountToken"] is False


def test_lmforge_serving_runtime_meets_restricted_alone_with_a_read_only_root_and_a_writable_tmp() -> None:
    runtime = build_serving_runtime(_cfg(image="registry.example/lmforge-serve:1"))
    crd = KSERVE / "v0.20.0" / "serving.kserve.io_clusterservingruntimes.yaml"
    assert list(strict_validator(crd, "v1alpha1").iter_errors(runtime)) == []
    assert restricted_violations(serving_runtime_pod(runtime)) == []
    (container,) = runtime["spec"]["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    (volume,) = [v for v in runtime["spec"]["volumes"] if v["name"] == tmp["name"]]
    assert "emptyDir" in volume
