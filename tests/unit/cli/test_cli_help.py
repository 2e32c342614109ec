"""`lmforge config --explain` and `lmforge stage NAME --help` on an 80-column terminal (COLUMNS=80, as a shell sets
it): every field's description shown, wrapped under its name, no line wider than the terminal, the preset's value
beside the default, and a stage's help a page long with a pointer to the full field list."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from lmforge.cli import application
from lmforge.config import load_preset
from lmforge.stages import STAGES, explain

runner = CliRunner()
WIDTH = 80


def _run(*args: str) -> str:
    result = runner.invoke(application(), list(args), env={"COLUMNS": str(WIDTH)})
    assert result.exit_code == 0, result.output
    return result.stdout


def _flat(text: str) -> str:
    return " ".join(text.split())


def _assert_fits(output: str) -> None:
    wide = [line for line in output.splitlines() if len(line) > WIDTH]
    assert not wide, f"{len(wide)} lines over {WIDTH} columns, e.g. {wide[0]!r}"


@pytest.mark.parametrize("target", ["pretrain.train", "clean", "evaluate"])
def test_config_explain_shows_every_fields_description_within_80_columns(target):
    output = _run("config", "--explain", target)
    _assert_fits(output)
    shown = _flat(output)
    for row in explain(target):
        assert row.path in output.splitlines(), f"{row.path} not on a line of its own"
        assert _flat(row.description) in shown, f"{row.path}: description missing or cut"


def test_config_explain_shows_the_value_the_preset_and_set_give_beside_the_default():
    (row,) = explain("pretrain.train.max_steps")
    steps = load_preset("gpt2-124m")["pretrain"]["train"]["max_steps"]
    assert json.dumps(steps) != row.default  # else this test shows nothing
    output = _run("config", "--explain", "pretrain.train.max_steps", "--preset", "gpt2-124m")
    assert f"default {row.default}; preset gpt2-124m: {steps}" in output
    output = _run(
        "config", "--explain", "pretrain.train.max_steps", "-p", "gpt2-124m", "--set", "pretrain.train.max_steps=7"
    )
    assert "preset gpt2-124m with --set: 7" in output
    (lr,) = explain("pretrain.train.min_lr")  # a value the preset leaves at its default shows the default alone
    assert (
        _run("config", "--explain", "pretrain.train.min_lr").splitlines()[1].strip()
        == f"{lr.type}, default {lr.default}"
    )


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_stage_help_is_a_page_at_80_columns_naming_every_port_and_field(stage):
    spec = STAGES[stage]
    output = _run("stage", stage, "--help")
    _assert_fits(output)
    assert len(output.splitlines()) < 80, f"{len(output.splitlines())} lines"
    shown = _flat(output)
    for port in spec.ports:
        assert port.name in output and _flat(port.description) in shown
    if spec.section:
        for row in explain(spec.section):
            assert row.path.rsplit(".", 1)[1] in output, row.path
        assert f"lmforge stage {stage} --help --all" in shown


def test_stage_help_all_gives_every_fields_description_with_the_stages_set():
    output = _run("stage", "clean", "--help", "--all", "--set", "min_chars=3")
    _assert_fits(output)
    shown = _flat(output)
    for row in explain("clean"):
        assert row.path in output.splitlines() and _flat(row.description) in shown, row.path
    assert "preset tiny-cpu with --set: 3" in output
