"""Every value the compiled DAG hands a step has the type that step declares, as the KFP backend's drivers demand.

``kfp.local`` does not type-check what flows between tasks; the backend's drivers do, at run time, on the
cluster (``resolveInputs`` in kubeflow/pipelines ``backend/src/v2/driver/resolve.go``): a value whose protobuf
kind differs from the input's declared ``parameterType`` fails the task, and a runtime resource value (GPU
limit, CPU and memory requests) is read with ``GetStringValue``, so any non-string is dropped silently. These
tests read the compiled YAML and check each of those rules for every task of every DAG (root, loops,
conditions, sub-pipelines); ``test_kfp_backend.py`` then runs the backend's own code on it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from lmforge_kfp.pipelines.compile import REPO_ROOT

COMPILED = sorted((REPO_ROOT / "pipelines" / "compiled").glob("*.yaml"))
# The protobuf kind a driver sees for a value of each declared parameter type (resolve.go's type validation).
KIND = {
    "STRING": "string",
    "NUMBER_INTEGER": "number",
    "NUMBER_DOUBLE": "number",
    "BOOLEAN": "bool",
    "LIST": "list",
    "STRUCT": "struct",
}
PLACEHOLDER = re.compile(r"\{\{\$\.inputs\.parameters\['([^']+)'\]\}\}")


def _spec(path: Path) -> dict[str, Any]:
    return next(yaml.safe_load_all(path.read_text(encoding="utf-8")))


def _dags(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, component) of the root and of every DAG component (loops, conditions, sub-pipelines)."""
    yield "root", spec["root"]
    for name, component in spec["components"].items():
        if "dag" in component:
            yield name, component


def _kind_of_constant(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "list", dict: "struct"}[type(value)]


def _source_kind(spec: dict[str, Any], dag: dict[str, Any], source: dict[str, Any]) -> str | None:
    """The kind of value a task input receives, or None where it is not a parameter known before the run."""
    declared = dag.get("inputDefinitions", {}).get("parameters", {})
    if "componentInputParameter" in source:
        return KIND[declared[source["componentInputParameter"]]["parameterType"]]
    if "taskOutputParameter" in source:
        ref = source["taskOutputParameter"]
        producer = dag["dag"]["tasks"][ref["producerTask"]]
        outputs = spec["components"][producer["componentRef"]["name"]]["outputDefinitions"]["parameters"]
        return KIND[outputs[ref["outputParameterKey"]]["parameterType"]]
    if "runtimeValue" in source:
        constant = source["runtimeValue"]["constant"]
        return None if isinstance(constant, str) and PLACEHOLDER.fullmatch(constant) else _kind_of_constant(constant)
    return None


def _tasks(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], str, dict[str, Any]]]:
    for dag_name, dag in _dags(spec):
        for task_name, task in dag["dag"]["tasks"].items():
            yield dag_name, dag, task_name, task


@pytest.fixture(scope="module", params=COMPILED, ids=lambda p: p.name)
def spec(request) -> dict[str, Any]:
    return _spec(request.param)


def test_there_is_a_compiled_pipeline_to_check():
    assert COMPILED, "no pipelines/compiled/*.yaml"


def test_every_channel_a_task_reads_is_an_input_of_its_enclosing_dag(spec):
    """A task inside a loop, a condition or a sub-pipeline can read only what its DAG declares as input: the SDK
    does not pass a parameter that only feeds a task's *resources* into a nested DAG, and the driver (and
    kfp.local) then fails with "parent DAG does not have input parameter"."""
    missing = [
        f"{dag_name}/{task_name}.{key} reads {source['componentInputParameter']!r}"
        for dag_name, dag, task_name, task in _tasks(spec)
        for key, source in task.get("inputs", {}).get("parameters", {}).items()
        if "componentInputParameter" in source
        and source["componentInputParameter"] not in dag.get("inputDefinitions", {}).get("parameters", {})
    ]
    assert not missing, missing


def test_every_component_input_is_fed_a_value_of_its_declared_type(spec):
    """Pipeline parameters, task outputs, constants and loop items: the kind fed equals the kind declared."""
    checked, wrong = 0, []
    for dag_name, dag, task_name, task in _tasks(spec):
        declared = spec["components"][task["componentRef"]["name"]].get("inputDefinitions", {}).get("parameters", {})
        for key, source in task.get("inputs", {}).get("parameters", {}).items():
            if key not in declared:
                continue
            fed = _source_kind(spec, dag, source)
            want = KIND[declared[key]["parameterType"]]
            checked += fed is not None
            if fed is not None and fed != want:
                wrong.append(f"{dag_name}/{task_name}.{key}: declared {want}, fed {fed} ({source})")
    assert checked > 50  # not vacuous: every task of the DAG was walked
    assert not wrong, wrong


def _producer_of(spec: dict[str, Any], dag_name: str, source: dict[str, Any]) -> tuple[str, str]:
    """(component, output key) of the task output a parameter comes from, followed up through sub-pipeline inputs."""
    dags = dict(_dags(spec))
    while "componentInputParameter" in source:
        name = source["componentInputParameter"]
        dag_name, caller = next((d, task) for d, _, _, task in _tasks(spec) if task["componentRef"]["name"] == dag_name)
        source = caller["inputs"]["parameters"][name]
    ref = source["taskOutputParameter"]
    return dags[dag_name]["dag"]["tasks"][ref["producerTask"]]["componentRef"]["name"], ref["outputParameterKey"]


def test_loop_items_have_the_type_of_every_consumer_and_of_the_values_produced(spec, tmp_path):
    """The loop DAG types its item from the items' declared element type; a bare ``list`` makes it STRING."""
    from kfp import dsl

    from lmforge_kfp.components import load_component

    plan_shards, plan_dedup = load_component("plan_shards"), load_component("plan_dedup")
    metrics = dsl.Metrics(name="metrics", uri=str(tmp_path / "metrics"), metadata={})
    producers = {
        "comp-plan-shards": lambda: {"Output": plan_shards.python_func(shard_count=3, metrics=metrics)},
        "comp-plan-dedup": lambda: plan_dedup.python_func(band_groups=3, parts=2, metrics=metrics)._asdict(),
    }
    loops = 0
    for dag_name, _, task_name, task in _tasks(spec):
        iterator = task.get("parameterIterator")
        if not iterator:
            continue
        loops += 1
        body = spec["components"][task["componentRef"]["name"]]
        item_input = iterator["itemInput"]
        item_kind = KIND[body["inputDefinitions"]["parameters"][item_input]["parameterType"]]
        items_from = iterator["items"]["inputParameter"]
        component, key = _producer_of(spec, dag_name, task["inputs"]["parameters"][items_from])
        produced = producers[component]()[key]
        assert produced and {_kind_of_constant(v) for v in produced} == {item_kind}, (task_name, produced, item_kind)
        for sub_name, sub in body["dag"]["tasks"].items():
            declared = spec["components"][sub["componentRef"]["name"]]["inputDefinitions"]["parameters"]
            for key, source in sub["inputs"]["parameters"].items():
                if source.get("componentInputParameter") == item_input:
                    assert KIND[declared[key]["parameterType"]] == item_kind, (task_name, sub_name, key)
    assert loops >= 3  # the cleaning fan-out and the two dedup fan-outs


def test_runtime_resources_are_fed_strings(spec):
    """The driver reads a runtime accelerator limit/type and CPU/memory request with GetStringValue
    (resolvePodSpecInputRuntimeParameter): an integer parameter yields "" and the limit is dropped."""
    executors = spec["deploymentSpec"]["executors"]
    resources_checked, wrong = 0, []
    for dag_name, dag, task_name, task in _tasks(spec):
        component = spec["components"][task["componentRef"]["name"]]
        if "executorLabel" not in component:
            continue
        resources = executors[component["executorLabel"]]["container"].get("resources", {})
        values = [*resources.get("accelerator", {}).values(), *(v for k, v in resources.items() if k != "accelerator")]
        for value in values:
            match = PLACEHOLDER.fullmatch(str(value))
            if not match:
                continue
            resources_checked += 1
            fed = _source_kind(spec, dag, task["inputs"]["parameters"][match.group(1)])
            if fed != "string":
                wrong.append(f"{dag_name}/{task_name}: {match.group(1)} is fed a {fed}")
    assert not wrong, wrong
    assert resources_checked >= 2 * 14  # CPU and memory request of every step, plus the GPU steps' accelerators


def test_every_step_requests_cpu_and_memory(spec):
    executors = spec["deploymentSpec"]["executors"]
    missing = [
        name
        for name, executor in executors.items()
        if not {"resourceCpuRequest", "resourceMemoryRequest"} <= set(executor["container"].get("resources", {}))
    ]
    assert not missing, missing
