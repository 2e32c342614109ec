"""docs/contributing.md's walk-through, done: a throwaway stage is registered, gets a component written as the page
says, runs through ``lmforge stage`` and the component, and compiles into a pipeline."""

import importlib.util
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from kfp import compiler, dsl
from pydantic import Field
from typer.testing import CliRunner

from lmforge.artifacts import input_record, read_manifest, staged_output, write_manifest
from lmforge.cli import application
from lmforge.config import StrictModel
from lmforge.results import StageResult
from lmforge.stages import StageSpec, artifact, register, resolve_stage_config, unregister

ROOT = Path(__file__).resolve().parents[2]


class ShoutConfig(StrictModel):
    """Settings of the throwaway ``shout`` stage."""

    times: int = Field(2, ge=1, description="How often each document is repeated, upper-cased.")


def shout(cfg: ShoutConfig, *, cleaned: str, loud: str) -> StageResult:
    """The stage's entry point: every cleaned document upper-cased ``cfg.times`` times, one per line."""
    rows = [row for path in sorted(Path(cleaned).glob("*.parquet")) for row in pq.read_table(path).to_pylist()]
    with staged_output(loud) as out:
        (out / "loud.txt").write_text("\n".join(" ".join([r["text"].upper()] * cfg.times) for r in rows))
        write_manifest(out, "loud-text", inputs={"cleaned": input_record(cleaned)}, config=cfg.model_dump())
    return StageResult(metrics={"documents": float(len(rows))}, summary={"loud": str(loud)})


SPEC = StageSpec(
    name="shout",
    summary="Upper-case every cleaned document (a throwaway stage for the contributing guide's test).",
    entry=f"{__name__}:shout",
    config=ShoutConfig,
    inputs=(artifact("cleaned", "Dataset", "Cleaned corpus from clean or merge_shards."),),
    outputs=(artifact("loud", "Dataset", "The documents, upper-cased."),),
)

# What docs/contributing.md tells a contributor to write into components/shout/component.py.
COMPONENT = """
from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Output

from lmforge_kfp.components.signature import documented


@dsl.component(base_image="python:3.11", install_kfp_package=False)
@documented("shout")
def shout(
    cleaned: Input[Dataset],
    loud: Output[Dataset],
    metrics: Output[Metrics],
    preset: str = "tiny-cpu",
    overrides: str = "{}",
):
    from lmforge_kfp.runtime import run_component

    run_component("shout", locals())
"""


@pytest.fixture
def registered():
    register(SPEC)
    yield SPEC
    unregister(SPEC.name)


@pytest.fixture
def cleaned(tmp_path, shakespeare_docs) -> Path:
    from lmforge.data.clean import run as clean

    corpus = tmp_path / "raw.jsonl"
    corpus.write_text("".join(json.dumps(doc) + "\n" for doc in shakespeare_docs[:3]))
    cfg = resolve_stage_config("clean", "tiny-cpu", {"language.enabled": False})
    clean(cfg, corpus_uri=str(corpus), cleaned=tmp_path / "cleaned")
    return tmp_path / "cleaned"


def _component(tmp_path: Path):
    path = tmp_path / "component.py"
    path.write_text(COMPONENT)
    spec = importlib.util.spec_from_file_location("shout_component", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.shout


def test_the_guide_names_every_file_a_new_stage_touches_and_they_are_at_most_seven():
    page = (ROOT / "docs" / "contributing.md").read_text()
    rows = [line.split("|") for line in page.splitlines() if line.startswith("| `")]
    hand_edited = [row[1] for row in rows if row[2].strip() == "hand-edited"]
    assert 1 <= len(hand_edited) <= 7
    for cell in hand_edited:
        path = cell.split("`")[1]
        assert list(ROOT.glob(path.replace("<family>", "data").replace("<stage>", "tokenize"))), path


def test_a_registered_stage_runs_from_the_cli_and_its_component_and_compiles_into_a_pipeline(
    registered, cleaned, tmp_path
):
    runner = CliRunner()
    helped = runner.invoke(application(), ["stage", "shout", "--help"], terminal_width=200)
    assert helped.exit_code == 0 and "times" in helped.output and "loud" in helped.output, helped.output
    ran = runner.invoke(
        application(), ["stage", "shout", "--io", f"cleaned={cleaned}", "--io", f"loud={tmp_path / 'cli'}"]
    )
    assert ran.exit_code == 0, ran.output
    first = pq.read_table(next(cleaned.glob("*.parquet"))).to_pylist()[0]["text"]
    assert (tmp_path / "cli" / "loud.txt").read_text().startswith(f"{first.upper()} {first.upper()}")

    component = _component(tmp_path)
    metrics = dsl.Metrics(name="metrics", uri=str(tmp_path / "metrics"), metadata={})
    component.python_func(
        cleaned=dsl.Dataset(name="cleaned", uri=str(cleaned), metadata={}),
        loud=dsl.Dataset(name="loud", uri=str(tmp_path / "kfp"), metadata={}),
        metrics=metrics,
        overrides='{"times": 3}',
    )
    assert read_manifest(tmp_path / "kfp", verify=True)["config"] == {"times": 3}

    @dsl.component(base_image="python:3.11")
    def make_cleaned(out: dsl.Output[dsl.Dataset]):
        import os

        os.makedirs(out.path, exist_ok=True)

    @dsl.pipeline(name="with-shout")
    def with_shout():
        component(cleaned=make_cleaned().outputs["out"])

    compiler.Compiler().compile(with_shout, str(tmp_path / "pipeline.yaml"))
    spec = yaml.safe_load((tmp_path / "pipeline.yaml").read_text())
    inputs = spec["components"]["comp-shout"]["inputDefinitions"]
    assert "overrides" in inputs["parameters"] and "cleaned" in inputs["artifacts"]
    assert component.component_spec.description == SPEC.summary
    assert component.component_spec.inputs["cleaned"].description == SPEC.inputs[0].description
