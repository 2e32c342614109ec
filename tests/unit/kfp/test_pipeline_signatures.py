"""The pipeline's and the sub-pipelines' signatures are made from the components' (the stage registry's)."""

from __future__ import annotations

import inspect

import pytest

from lmforge.stages import get_stage
from lmforge_kfp.pipelines import lmforge_pipeline as dag
from lmforge_kfp.pipelines.signatures import NESTED_STEP_INPUTS, documented_parameters


def _signature(component) -> inspect.Signature:
    return inspect.signature(component.pipeline_func)


def test_the_pipeline_takes_preflights_inputs_with_the_registrys_defaults():
    parameters = _signature(dag.lmforge_pipeline).parameters
    for port in get_stage("preflight").inputs:
        expected = port.default if not port.required else dag.REQUIRED_INPUT_DEFAULTS[port.name]
        assert parameters[port.name].default == expected, port.name
    assert set(parameters) == {p.name for p in get_stage("preflight").inputs} | set(dag.OWN_PARAMETERS)


def test_a_nested_step_takes_its_components_inputs_and_its_placement():
    step = _signature(dag.clean_one_shard)
    component = inspect.signature(dag.clean_shard.python_func)
    own = [name for name in component.parameters if name not in ("shard", "metrics")]
    assert list(step.parameters) == own + list(NESTED_STEP_INPUTS)
    assert all(p.default is inspect.Parameter.empty for p in step.parameters.values())


def test_a_fan_out_takes_the_list_where_its_step_takes_one_element():
    step, fan_out = _signature(dag.dedup_band_one_part), _signature(dag.dedup_band_fan_out)
    assert list(fan_out.parameters) == [n if n != "band_task" else "band_tasks" for n in step.parameters]
    assert fan_out.parameters["band_tasks"].annotation == list[int]


def test_an_input_of_preflight_without_its_help_in_the_docstring_is_refused():
    doc = dag.PIPELINE_DOC.replace("        staging_uri:", "        staging_uri_typo:")
    with pytest.raises(ValueError, match=r"staging_uri_typo"):
        documented_parameters(doc, dag.preflight, dag.OWN_PARAMETERS, dag.REQUIRED_INPUT_DEFAULTS)
    undocumented = "\n".join(line for line in dag.PIPELINE_DOC.split("\n") if "serve_overrides:" not in line)
    with pytest.raises(ValueError, match=r"without an Args entry: \['serve_overrides'\]"):
        documented_parameters(undocumented, dag.preflight, dag.OWN_PARAMETERS, dag.REQUIRED_INPUT_DEFAULTS)
