"""A platform team's own pipeline: two lmforge components loaded from their YAML, wired with its own steps."""

import json

import pytest
from kfp import dsl, local
from kfp.components import load_component_from_file

from lmforge_kfp.pipelines.compile import REPO_ROOT

pytestmark = pytest.mark.slow

# The tickets are short and alike on purpose; web-text rules and near-dedup would (rightly) drop them.
RULES_OFF = ("language", "gopher_quality", "gopher_repetition", "c4", "fineweb", "near_dedup")
clean = load_component_from_file(str(REPO_ROOT / "components/clean/component.yaml"))
tokenize = load_component_from_file(str(REPO_ROOT / "components/tokenize/component.yaml"))


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def write_corpus(folder: str) -> str:
    """The team's own extraction step: writes a small JSONL corpus and returns its path."""
    import json
    import os

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "tickets.jsonl")
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(40):
            text = f"Ticket {i}: the customer reports that the export job number {i} stalls after the upload step."
            fh.write(json.dumps({"text": text}) + "\n")
    return path


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def count_tokens(shards: dsl.Input[dsl.Dataset]) -> int:
    """The team's own consumer: reads the shard index lmforge wrote."""
    import json
    import os

    with open(os.path.join(shards.path, "index.json"), encoding="utf-8") as fh:
        index = json.load(fh)
    return sum(split["tokens"] for split in index["splits"].values())


@dsl.pipeline(name="team-pipeline")
def team_pipeline(folder: str) -> int:
    corpus = write_corpus(folder=folder)
    cleaned = clean(
        corpus_uri=corpus.output,
        preset="tiny-cpu",
        overrides=json.dumps({f"{rule}.enabled": False for rule in RULES_OFF}),
    )
    tokens = tokenize(cleaned=cleaned.outputs["cleaned"], overrides=json.dumps({"vocab_size": 300}))
    return count_tokens(shards=tokens.outputs["shards"]).output


def test_team_pipeline_reusing_two_components_runs_under_kfp_local(tmp_path):
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    run = team_pipeline(folder=str(tmp_path / "data"))
    assert run.output > 40 * 10
