"""A held-out set below its minimum: its figures are marked "low confidence" in the console and the report, and a
gate check that would pass on them is n/a."""

from __future__ import annotations

from lmforge.config import EvaluateConfig, GateConfig, TokenizeConfig
from lmforge.contracts import split_bucket
from lmforge.data import tokenize
from lmforge.evaluate.evaluate import held_out_confidence
from lmforge.evaluate.gate import check_gate, headline, headline_lines
from lmforge.evaluate.report import markdown_summary
from lmforge.formats.cleaned import read_cleaned

from ..data.test_data_tokenize import make_cleaned
from .test_evaluate_gate_relative import check, results


def test_a_3_document_val_split_is_low_confidence_and_its_gate_checks_are_n_a(tmp_path, shakespeare_docs):
    cleaned = make_cleaned(tmp_path, shakespeare_docs)
    buckets = sorted(split_bucket(row["id"]) for row in read_cleaned(cleaned))
    cap = (buckets[2] + buckets[3]) / 2  # at most 3 documents may be held out
    cfg = TokenizeConfig(vocab_size=512, val_fraction=cap / 2, max_val_fraction=cap)
    out = tokenize.run(cfg, cleaned=cleaned, tokenizer=tmp_path / "tok", shards=tmp_path / "shards")
    assert out.metrics["val_documents"] == 3
    scored = int(min(out.metrics["val_tokens"], EvaluateConfig().max_eval_tokens))

    confidence = held_out_confidence(tmp_path / "shards", scored, None, EvaluateConfig())
    note = f"low confidence: {scored:,} tokens / 3 documents (minimum 10,000 / 10)"
    assert confidence["text"]["low"] and confidence["text"]["note"] == note

    data = {**results(), "confidence": confidence}
    decision = check_gate(GateConfig(), data)
    for name in ("student_perplexity", "teacher_forgetting", "student_forgetting", "int8_perplexity_delta"):
        got = check(decision, name)
        assert got.status == "n/a" and not got.passed and got.reason.startswith(note)
    data["gate"] = decision.to_dict()
    data["headline"] = headline(data)
    assert f"WARNING: held-out text: {note}" in headline_lines(data["headline"])  # the run's last lines
    assert f"WARNING: held-out text: {note}" in markdown_summary(data)  # the report
