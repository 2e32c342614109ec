"""Each stage's KFP component is made in memory from its generated source, which KFP embeds word for word."""

import pytest

from lmforge.stages import STAGES
from lmforge_kfp.components import build_component, load_component
from lmforge_kfp.components.source import component_source


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_the_compiled_component_embeds_the_generated_function_word_for_word(stage):
    source = component_source(STAGES[stage])
    function = source[source.index(f"def {stage}(") :]
    program = load_component(stage).component_spec.implementation.container.command[-1]
    assert function in program


def test_load_component_makes_a_stage_s_component_once_and_build_component_afresh():
    assert load_component("plan_shards") is load_component("plan_shards")
    assert build_component("plan_shards") is not load_component("plan_shards")
