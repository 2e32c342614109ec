"""The names a stage's figures get in KFP's ``Metrics`` artifact (the Kubeflow UI shows names and numbers only)."""

from __future__ import annotations

from kfp.dsl import Metrics

from lmforge.component_io import publish
from lmforge.results import StageResult


def test_qa_metrics_carry_their_range_in_the_kfp_metrics_names_and_others_keep_theirs():
    result = StageResult(
        metrics={
            "student_bleu": 12.5,
            "teacher_f1": 0.31,
            "student_exact_match": 0.1,
            "int8_dynamic_rouge_l": 0.2,
            "student_perplexity": 41.0,
            "student_harness.lmforge_qa_mc.acc": 0.4,
            "passed": 1.0,
        }
    )
    metrics = Metrics(name="metrics", uri="", metadata={})
    publish(result, metrics=metrics)
    assert metrics.metadata == {
        "student_bleu_0to100": 12.5,
        "teacher_f1_0to1": 0.31,
        "student_exact_match_0to1": 0.1,
        "int8_dynamic_rouge_l_0to1": 0.2,
        "student_perplexity": 41.0,
        "student_harness.lmforge_qa_mc.acc": 0.4,
        "passed": 1.0,
    }
