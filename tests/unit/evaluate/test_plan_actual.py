"""Plan against actual: preflight's plan beside each training stage's history, in results, HTML and Markdown."""

from __future__ import annotations

import pytest

from lmforge.config import EvaluateConfig
from lmforge.errors import InputDataError
from lmforge.evaluate import evaluate
from lmforge.evaluate.plan_actual import actual_figures, plan_against_actual
from lmforge.evaluate.report import html_report, markdown_summary, plan_rows

GIB_IN_GB = 2**30 / 1e9


def _stage(name: str, **figures: float) -> dict:
    planned = {"tokens": 1e6, "hours": 2.0, "gpu_hours": 8.0, "mfu": 0.4, "memory_gb_per_gpu": 10.0, "gpus": 4}
    return {"stage": name, "mfu_source": "assumed", **planned, **figures}


PLAN = {
    "preset": "gpt2-124m",
    "accelerator": {"name": "H100", "peak_flops": 989e12, "memory_gb": 80.0, "source": "vendor data sheets"},
    "stages": [_stage("pretrain", mfu_source="run abc123"), _stage("finetune_lora"), _stage("distill")],
}
GPU_HISTORY = {"total_tokens": 1_100_000, "train_seconds": 9000.0, "mfu": [None, 0.30, 0.36], "memory_gb": [4.0, 9.5]}
CPU_HISTORY = {"total_tokens": 500, "train_seconds": 36.0, "mfu": [None, None], "memory_gb": [0.5, 0.75]}


def test_a_history_becomes_the_plans_figures_hours_gpu_hours_last_measured_mfu_and_peak_memory_in_gb():
    assert actual_figures(GPU_HISTORY, gpus=4) == {
        "tokens": 1_100_000.0,
        "hours": 2.5,
        "gpu_hours": 10.0,
        "mfu": 0.36,
        "memory_gb_per_gpu": pytest.approx(9.5 * GIB_IN_GB),
    }
    assert actual_figures(CPU_HISTORY, gpus=1)["mfu"] is None


def test_rows_set_every_planned_figure_against_the_stages_history_with_the_ratio():
    compared = plan_against_actual(PLAN, {"base": GPU_HISTORY}, {"base": 2})
    rows = {(row["stage"], row["figure"]): row for row in compared["rows"]}
    assert len(rows) == 15
    assert rows["pretrain", "tokens"] == {
        "stage": "pretrain", "figure": "tokens", "planned": 1e6, "actual": 1_100_000.0, "ratio": 1.1,
    }  # fmt: skip
    assert rows["pretrain", "hours"]["ratio"] == 1.25
    assert rows["pretrain", "GPU-hours"]["actual"] == 5.0  # the 2 processes the model's manifest records
    assert rows["pretrain", "MFU"]["ratio"] == pytest.approx(0.9)
    assert rows["pretrain", "memory per GPU (GB)"]["actual"] == pytest.approx(9.5 * GIB_IN_GB)
    assert rows["distill", "hours"] == {
        "stage": "distill",
        "figure": "hours",
        "planned": 2.0,
        "actual": None,
        "ratio": None,
    }
    assert compared["mfu_sources"] == {"pretrain": "run abc123", "finetune_lora": "assumed", "distill": "assumed"}
    assert "4 × H100 (989 TFLOP/s" in compared["note"] and "No stage measured MFU" not in compared["note"]


def test_without_a_gpu_peak_the_actual_side_says_it_is_the_devices_own_figures():
    compared = plan_against_actual(PLAN, {"base": CPU_HISTORY, "teacher": CPU_HISTORY, "student": CPU_HISTORY})
    assert "No stage measured MFU" in compared["note"] and "a CPU, as in the local demo" in compared["note"]
    assert "resident set" in compared["note"]
    assert plan_against_actual(None, {"base": CPU_HISTORY}) is None


def test_the_report_and_the_summary_show_the_table_and_where_each_mfu_came_from():
    compared = plan_against_actual(PLAN, {"base": GPU_HISTORY})
    results = {"passed": True, "plan_vs_actual": compared}
    page = html_report(results)
    assert "<h2>Plan against actual</h2>" in page and "actual / planned" in page
    assert "pretrain run abc123; finetune_lora assumed" in page
    summary = markdown_summary(results)
    assert "## Plan against actual" in summary
    assert "| pretrain | hours | 2 | 2.5 | 1.25 |" in summary
    assert len(plan_rows(compared)) == 15
    assert "No training plan was given" in html_report({"passed": True})
    assert "Plan against actual" not in markdown_summary({"passed": True})


def test_evaluate_refuses_a_plan_that_is_not_a_json_object_before_scoring_anything(tmp_path):
    with pytest.raises(InputDataError, match="evaluate: plan is not valid JSON"):
        evaluate.run(EvaluateConfig(), shards=tmp_path / "none", evaluation=tmp_path / "out", plan="{")
    with pytest.raises(InputDataError, match="evaluate: plan must be a JSON object"):
        evaluate.run(EvaluateConfig(), shards=tmp_path / "none", evaluation=tmp_path / "out", plan="[]")
