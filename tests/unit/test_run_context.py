"""The run's context: its environment variables, and every reader taking its facts from the context."""

from __future__ import annotations

import os

import pytest

from lmforge.config import LaunchConfig
from lmforge.launch.stage_runner import job_run_id, with_run_env
from lmforge.run_context import PIPELINE_VERSION_ENV, RUN_ID_ENV, RUN_ROOT_ENV, RunContext, environ_set
from lmforge.tracking.stages import pipeline_run

FULL = RunContext(run_id="run-42", run_root="s3://bucket/staging", pipeline_version="c0ffee")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No run context in the environment; whatever a test sets is undone after it."""
    for name in (RUN_ID_ENV, RUN_ROOT_ENV, PIPELINE_VERSION_ENV):
        monkeypatch.setenv(name, "")  # recorded, so that a value a reader exports is undone too
        monkeypatch.delenv(name)
    return monkeypatch


def test_a_context_comes_back_from_its_environment_variables():
    assert FULL.to_env() == {
        "LMFORGE_RUN_ID": "run-42",
        "LMFORGE_RUN_ROOT": "s3://bucket/staging",
        "LMFORGE_PIPELINE_VERSION": "c0ffee",
    }
    assert RunContext.from_env(FULL.to_env()) == FULL


def test_unset_variables_are_empty_facts_and_empty_facts_set_no_variable():
    partial = RunContext.from_env({RUN_ID_ENV: "run-42", "HOME": "/root"})
    assert partial == RunContext(run_id="run-42")
    assert partial.to_env() == {RUN_ID_ENV: "run-42"}
    assert RunContext.from_env({}).to_env() == {}


def test_the_default_environment_is_the_process_s(env):
    env.setenv(RUN_ROOT_ENV, "/runs")
    assert RunContext.from_env() == RunContext(run_root="/runs")


def test_the_stage_context_names_the_preset_and_the_run():
    assert FULL.stage_context("tiny-cpu") == {"preset": "tiny-cpu", "run_id": "run-42", "pipeline_version": "c0ffee"}


def test_the_launcher_names_the_job_after_the_run_id_of_the_environment(env):
    env.setenv(RUN_ID_ENV, "run-from-env")
    assert job_run_id("") == "run-from-env"
    assert job_run_id("given") == "given"


def test_a_job_s_pods_get_the_run_id_and_the_environment_s_run_root_but_no_version(env):
    env.setenv(RUN_ROOT_ENV, "s3://bucket/root")
    env.setenv(PIPELINE_VERSION_ENV, "c0ffee")
    cfg = with_run_env(LaunchConfig(env={"EXTRA": "1"}), "run-9")
    assert cfg.env == {RUN_ID_ENV: "run-9", RUN_ROOT_ENV: "s3://bucket/root", "EXTRA": "1"}


def test_a_job_s_pods_get_no_run_root_when_the_step_has_none(env):
    assert with_run_env(LaunchConfig(), "run-9").env == {RUN_ID_ENV: "run-9"}


def test_tracking_tags_the_pipeline_run_with_the_context_s_version(env):
    env.setenv(PIPELINE_VERSION_ENV, "from-env")
    assert pipeline_run({"run_id": "r"}, FULL).pipeline_version == "c0ffee"
    assert pipeline_run({"run_id": "r"}).pipeline_version == "from-env"
    assert pipeline_run({"run_id": "r", "pipeline_version": "given"}, FULL).pipeline_version == "given"
    assert pipeline_run({"run_id": "r"}, RunContext()).pipeline_version is None


def test_a_step_exports_its_run_root_and_keeps_the_version_it_was_given(env):
    from lmforge_kfp.runtime import _context

    env.setenv(RUN_ID_ENV, "run-3")
    env.setenv(PIPELINE_VERSION_ENV, "c0ffee")
    context = _context({"preset": "tiny-cpu", "run_root": "s3://bucket/releases"})
    assert context == {"preset": "tiny-cpu", "run_id": "run-3", "pipeline_version": "c0ffee"}
    assert RunContext.from_env(os.environ) == RunContext("run-3", "s3://bucket/releases", "c0ffee")


def test_environ_set_restores_a_set_variable_and_unsets_a_new_one_even_on_error(env):
    env.setenv(RUN_ID_ENV, "outer")
    env.delenv(RUN_ROOT_ENV, raising=False)
    with pytest.raises(RuntimeError), environ_set({RUN_ID_ENV: "inner", RUN_ROOT_ENV: "s3://b/r"}):
        assert (os.environ[RUN_ID_ENV], os.environ[RUN_ROOT_ENV]) == ("inner", "s3://b/r")
        raise RuntimeError
    assert os.environ[RUN_ID_ENV] == "outer" and RUN_ROOT_ENV not in os.environ
