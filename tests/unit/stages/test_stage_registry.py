"""The stage registry is the one statement of every stage's contract: components, entry points and the CLI
follow it, and the four ways they used to drift apart are closed."""

from __future__ import annotations

import inspect
import json
import re

import pytest
from kfp import dsl
from typer.testing import CliRunner

from lmforge.cli import application
from lmforge.errors import ConfigError
from lmforge.stages import STAGES, bind, get_stage
from lmforge_kfp.components import COMPONENTS_DIR, load_component
from lmforge_kfp.components.signature import NO_DEFAULT, expected_parameters

runner = CliRunner()
KFP_PARAMETER_TYPES = {"str": "String", "int": "Integer", "bool": "Boolean", "dict": "Dict", "list": "List"}


def test_the_registry_holds_the_twenty_stages_of_the_dag():
    assert len(STAGES) == 20


def test_a_component_is_made_only_for_a_registered_stage():
    with pytest.raises(ConfigError, match="unknown stage 'evaluat'"):
        load_component("evaluat")


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_component_signature_equals_its_registry_entry(stage):
    component = load_component(stage)
    signature = inspect.signature(component.python_func)
    expected = expected_parameters(STAGES[stage])
    assert list(signature.parameters) == [p.name for p in expected]
    compiled = component.component_spec
    for param in expected:
        actual = signature.parameters[param.name]
        want = inspect.Parameter.empty if param.default is NO_DEFAULT else param.default
        assert actual.default == want, (stage, param.name)
        if param.kind == "output":
            assert compiled.outputs[param.name].type.removeprefix("system.").split("@")[0] == param.type
            continue
        spec = compiled.inputs[param.name]
        if param.kind == "input":
            assert spec.type.removeprefix("system.").split("@")[0] == param.type, (stage, param.name)
            assert spec.is_artifact_list == param.many
            assert spec.optional == (param.default is not NO_DEFAULT)
        else:
            assert spec.type == KFP_PARAMETER_TYPES[param.type], (stage, param.name)
    returns = STAGES[stage].returns
    outputs = {name for name, out in (compiled.outputs or {}).items() if not out.type.startswith("system.")}
    assert outputs == ({"Output"} if len(returns) == 1 else {port.name for port in returns})


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_entry_point_is_the_run_function_of_a_module_named_after_its_stage(stage):
    # lmforge.<family>.<stage>:run: a stage's code is found from its name, and a module holds one stage
    assert re.fullmatch(rf"lmforge\.[a-z_]+\.{stage}:run", STAGES[stage].entry), STAGES[stage].entry


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_entry_point_takes_exactly_its_registry_ports_by_keyword(stage):
    spec = STAGES[stage]
    parameters = inspect.signature(spec.function()).parameters
    keywords = {n: p for n, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    positional = [n for n, p in parameters.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == (["cfg"] if spec.config else [])
    ports = {port.name for port in spec.ports}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):  # preflight's <section>_overrides
        ports = {name for name in ports if not name.endswith("_overrides")}
    assert ports <= set(keywords), f"ports the entry point does not take: {ports - set(keywords)}"
    extra_required = [n for n, p in keywords.items() if n not in ports and p.default is inspect.Parameter.empty]
    assert not extra_required
    for port in (p for p in spec.ports if p.name in ports):
        assert (keywords[port.name].default is inspect.Parameter.empty) == port.required, port.name


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_lmforge_stage_help_lists_every_port_for_every_stage_the_readmes_advertise(stage):
    result = runner.invoke(application(), ["stage", stage, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for port in STAGES[stage].ports:
        assert port.name in result.output
    readme = (COMPONENTS_DIR / stage / "README.md").read_text(encoding="utf-8")
    assert f"`lmforge stage {stage} --help`" in readme


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["stage", "clean", "--io", "corpus_uri=raw.jsonl"], "missing output 'cleaned'"),
        (["stage", "finetune_lora", "--io", "base_model=m", "--io", "adapter=a", "--io", "merged_model=b"], "'qa_uri'"),
        (["stage", "tokenise"], "unknown stage 'tokenise' (did you mean 'tokenize'?)"),
        (["stage", "clean", "--io", "corpus=raw.jsonl", "--io", "cleaned=o"], "'corpus' (did you mean 'corpus_uri'?)"),
        (["stage", "plan_shards", "--io", "shard_count=two"], "shard_count: expected int"),
    ],
)
def test_a_stage_called_wrongly_fails_in_one_error_line_before_running(args, named, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(application(), args, terminal_width=300)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and named in lines[-1], result.output
    assert "Traceback" not in result.output
    assert not list(tmp_path.iterdir())  # nothing written


def test_bind_converts_command_line_strings_to_each_ports_kind():
    assert bind(
        get_stage("clean_shard"), {"corpus_uri": "c", "shard_index": "2", "shard_count": "4", "shard": "s"}
    ) == {
        "corpus_uri": "c",
        "shard_index": 2,
        "shard_count": 4,
        "shard": "s",
    }
    assert bind(get_stage("dedup_shards"), {"shards": "a,b", "plan": "p"})["shards"] == ["a", "b"]
    with pytest.raises(ConfigError, match="shard_index: expected int, got 'true'"):
        bind(get_stage("clean_shard"), {"corpus_uri": "c", "shard_index": "true", "shard_count": "1", "shard": "s"})


def test_plan_shards_component_and_cli_give_the_same_indices(tmp_path):
    metrics = dsl.Metrics(name="metrics", uri=str(tmp_path / "m"), metadata={})
    assert load_component("plan_shards").python_func(shard_count=3, metrics=metrics) == [0, 1, 2]
    result = runner.invoke(application(), ["stage", "plan_shards", "--io", "shard_count=3"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["summary"]["shard_indices"] == [0, 1, 2]
