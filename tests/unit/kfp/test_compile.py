"""Compiled YAML is current, reusable, and places GPU stages (and only those) on the GPU pool."""

import re
from pathlib import Path

import pytest
import yaml
from kfp import compiler, dsl
from kfp.components import load_component_from_file

from lmforge.stages import STAGES
from lmforge_kfp.components.images import REGISTRY_ENV, TAG_ENV, computed_tag, release_tag
from lmforge_kfp.pipelines.compile import REPO_ROOT, compile_all
from lmforge_kfp.pipelines.component_docs import STAGE_TABLE_BEGIN, with_stage_table

GPU_STAGES = {name for name, spec in STAGES.items() if spec.on_gpu}
PIPELINE_YAML = REPO_ROOT / "pipelines/compiled/lmforge_pipeline.yaml"
PIPELINE_STAGES = sorted(
    name.removeprefix("exec-").replace("-", "_")
    for name in next(yaml.safe_load_all(PIPELINE_YAML.read_text()))["deploymentSpec"]["executors"]
)
COMPONENT_YAMLS = sorted((REPO_ROOT / "components").glob("*/component.yaml"))


@dsl.component(base_image="python:3.11")
def make_dir(out: dsl.Output[dsl.Artifact]):
    """A stand-in upstream step of a platform team's own pipeline."""
    import os

    os.makedirs(out.path, exist_ok=True)


@pytest.fixture(scope="module")
def fresh_compile(tmp_path_factory, monkeypatch_module) -> Path:
    root = tmp_path_factory.mktemp("compiled")
    compile_all(root)
    return root


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        for name in (REGISTRY_ENV, TAG_ENV):
            mp.delenv(name, raising=False)
        yield mp


def test_committed_yaml_and_readmes_match_a_fresh_compile(fresh_compile):
    fresh = sorted(p.relative_to(fresh_compile) for p in fresh_compile.rglob("*") if p.is_file())
    assert len(fresh) == 2 * len(STAGES) + 3  # YAML and README per stage; index, pipeline, config.md
    stale = [
        str(rel)
        for rel in fresh
        if not (REPO_ROOT / rel).is_file() or (REPO_ROOT / rel).read_text() != (fresh_compile / rel).read_text()
    ]
    assert not stale, f"generated files are stale, run `lmforge compile` and commit: {stale}"


def test_readme_stage_table_is_the_registry_s():
    readme = (REPO_ROOT / "README.md").read_text()
    assert with_stage_table(readme) == readme, "README.md's stage table is stale, run `lmforge compile` and commit"
    table = readme.partition(STAGE_TABLE_BEGIN)[2]
    for name, spec in STAGES.items():
        assert f"[`{name}`](components/{name}/README.md) | {spec.summary} | `{spec.entry}` |" in table


def test_committed_generated_files_name_images_by_the_release_tag_never_the_content_tag(fresh_compile):
    """So that they change only when their content does, not on every change to an image source."""
    generated = sorted(p.relative_to(fresh_compile) for p in fresh_compile.rglob("*") if p.is_file())
    committed = {str(rel): (REPO_ROOT / rel).read_text() for rel in generated}
    content = computed_tag()
    carrying = [name for name, text in committed.items() if content in text]
    assert not carrying, f"committed generated files carry the content tag {content}: {carrying}"
    tags = {tag for text in committed.values() for tag in re.findall(r"/lmforge-[a-z0-9]+:([\w.-]+)", text)}
    assert tags == {release_tag()}


def test_every_stage_has_a_component_yaml():
    assert {p.parent.name for p in COMPONENT_YAMLS} == set(STAGES)


@pytest.mark.parametrize("path", COMPONENT_YAMLS, ids=lambda p: p.parent.name)
def test_component_yaml_loads_and_composes_into_a_new_pipeline(path, tmp_path):
    component = load_component_from_file(str(path))
    required = {
        name: spec
        for name, spec in component.component_spec.inputs.items()
        if spec.default is None and not spec.optional
    }

    @dsl.pipeline(name=f"reuse-{path.parent.name.replace('_', '-')}")
    def reuse():
        producer = make_dir()
        with dsl.ParallelFor([0, 1]):
            fanned = make_dir()
        kwargs = {}
        for name, spec in required.items():
            if spec.is_artifact_list:
                kwargs[name] = dsl.Collected(fanned.outputs["out"])
            elif spec.type in ("String", "STRING"):
                kwargs[name] = "demo://shakespeare"
            elif spec.type in ("Integer", "NUMBER_INTEGER"):
                kwargs[name] = 1
            else:
                kwargs[name] = producer.outputs["out"]
        component(**kwargs)

    out = tmp_path / "reuse.yaml"
    compiler.Compiler().compile(reuse, str(out))
    spec = yaml.safe_load(out.read_text())
    assert f"comp-{path.parent.name.replace('_', '-')}" in spec["components"]


def test_gpu_settings_only_on_gpu_stages():
    docs = list(yaml.safe_load_all((REPO_ROOT / "pipelines/compiled/lmforge_pipeline.yaml").read_text()))
    pipeline, platform = docs[0], docs[1]
    executors = pipeline["deploymentSpec"]["executors"]
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    # clean = the fan-out in one step; dedup_shards = the dedup fan-out in one step (for reuse, not in the DAG)
    assert set(PIPELINE_STAGES) == set(STAGES) - {"clean", "dedup_shards"}
    for stage in PIPELINE_STAGES:
        executor = f"exec-{stage.replace('_', '-')}"
        resources = executors[executor]["container"].get("resources", {})
        placement = k8s[executor]
        if stage in GPU_STAGES:
            assert "preflight-gpu_limit" in resources["accelerator"]["resourceCount"], stage
            assert "gpu_accelerator_type" in resources["accelerator"]["resourceType"], stage
            assert placement["nodeSelector"] == {"nodeSelectorJson": {"componentInputParameter": "gpu_node_selector"}}
            assert placement["tolerations"] == [{"tolerationJson": {"componentInputParameter": "gpu_tolerations"}}]
        else:
            assert "accelerator" not in resources, stage
            assert "nodeSelector" not in placement and "tolerations" not in placement, stage


def test_gpu_placement_defaults_target_the_gpu_pool():
    spec = next(yaml.safe_load_all((REPO_ROOT / "pipelines/compiled/lmforge_pipeline.yaml").read_text()))
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["gpu_node_selector"]["defaultValue"] == {"lmforge.io/pool": "gpu"}
    assert params["gpu_tolerations"]["defaultValue"][0]["key"] == "nvidia.com/gpu"
    assert params["gpu_count"]["defaultValue"] == 1


def test_every_stage_gets_s3_credentials_by_secret_reference_only():
    text = (REPO_ROOT / "pipelines/compiled/lmforge_pipeline.yaml").read_text()
    docs = list(yaml.safe_load_all(text))
    k8s = docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for stage in PIPELINE_STAGES:
        secrets = _secrets_by_parameter(k8s[f"exec-{stage.replace('_', '-')}"])
        assert {k["envVar"] for k in secrets["s3_secret_name"]["keyToEnv"]} == {
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_ENDPOINT_URL",
        }
    from tests.support.s3server import ACCESS_KEY, SECRET_KEY

    for value in (ACCESS_KEY, SECRET_KEY):
        assert value not in text
    for path in COMPONENT_YAMLS:
        assert SECRET_KEY not in path.read_text()


def _secrets_by_parameter(executor: dict) -> dict[str, dict]:
    """An executor's Secrets (as env), by the pipeline parameter that names each."""
    secrets = {}
    for secret in executor["secretAsEnv"]:
        parameter = secret["secretNameParameter"]["componentInputParameter"].rpartition("--")[2]
        assert parameter not in secrets, f"two Secrets from {parameter}"
        secrets[parameter] = secret
    return secrets


def test_every_stage_gets_the_mlflow_settings_from_an_optional_secret_and_the_run_id():
    docs = list(yaml.safe_load_all((REPO_ROOT / "pipelines/compiled/lmforge_pipeline.yaml").read_text()))
    k8s = docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for stage in PIPELINE_STAGES:
        executor = k8s[f"exec-{stage.replace('_', '-')}"]
        secrets = _secrets_by_parameter(executor)
        assert set(secrets) == {"s3_secret_name", "mlflow_secret_name"}, stage
        mlflow = secrets["mlflow_secret_name"]
        assert mlflow["optional"] is True, stage  # no Secret: the step runs, untracked
        assert {k["envVar"] for k in mlflow["keyToEnv"]} >= {"MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_TOKEN"}
        (run_id,) = executor["fieldPathAsEnv"]  # each stage's MLflow run finds its pipeline run by it
        assert run_id == {"name": "LMFORGE_RUN_ID", "fieldPath": "metadata.labels['pipeline/runid']"}, stage
    root = docs[0]["root"]["inputDefinitions"]["parameters"]
    assert root["mlflow_secret_name"]["defaultValue"] == "lmforge-mlflow"


def test_preflight_runs_before_every_other_step():
    """Nothing starts before preflight's checks, and the run's MLflow parent run is the one preflight creates."""
    spec = next(yaml.safe_load_all((REPO_ROOT / "pipelines/compiled/lmforge_pipeline.yaml").read_text()))
    tasks = spec["root"]["dag"]["tasks"]
    after = {name: set(task.get("dependentTasks", [])) for name, task in tasks.items()}

    def upstream(name: str) -> set[str]:
        return after[name] | {u for d in after[name] for u in upstream(d)}

    assert [name for name in tasks if name != "preflight" and "preflight" not in upstream(name)] == []


def test_every_pipeline_parameter_is_documented():
    spec = yaml.safe_load_all((REPO_ROOT / "pipelines/compiled/lmforge_pipeline.yaml").read_text())
    params = next(spec)["root"]["inputDefinitions"]["parameters"]
    undocumented = [name for name, p in params.items() if not p.get("description")]
    assert not undocumented
    assert params["preset"]["defaultValue"] == "tiny-cpu"
