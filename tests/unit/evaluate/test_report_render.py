"""The evaluation report: self-contained, complete, and rendered by headless Chromium without errors."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from lmforge.config import GateConfig
from lmforge.evaluate.gate import check_gate, headline
from lmforge.evaluate.report import html_report, markdown_summary
from lmforge.stages import resolve_config

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
NO_CHROMIUM = "chromium not installed (Debian: apt-get install -y chromium)"
SECTIONS = (
    "Summary",
    "Gate",
    "Model comparison",
    "Generation",
    "Loss curves",
    "Plan against actual",
    "Data",
    "TensorRT",
    "Configuration",
    "Method",
)
RUN_ID = "lmforge-pipeline-20261201-145508-7f3c2a91"
LONG_URI = (
    "s3://lmforge-corpora-production-eu-west-1/customer_support/2026/11/28/normalized/tickets-deduplicated.jsonl.zst"
)


def _model(ppl, bpb, size, p50, p99, tps, **extra):
    return {
        "perplexity": ppl,
        "bits_per_token": bpb * 3.1,
        "bits_per_byte": bpb,
        "size_mb": size,
        "p50_ms": p50,
        "p90_ms": p99 * 0.9,
        "p99_ms": p99,
        "tokens_per_s": tps,
        "latency": {"1": {"p99_ms": p99, "tokens_per_s": tps}, "8": {"p99_ms": p99 * 5, "tokens_per_s": tps * 3}},
        **extra,
    }


def _generation(em, f1, bleu, rouge, answer_loss):
    scores = {"exact_match": em, "f1": f1, "bleu": bleu, "rouge_l": rouge}
    return {
        **scores,
        "answer_loss": answer_loss,
        "empty_answer_fraction": 1 / 32,
        "generation": {"prompts": 32, "empty_predictions": 1, "bleu_signature": "nrefs:var|…", **scores},
    }


@pytest.fixture(scope="module")
def results() -> dict:
    models = {
        "base": _model(40.3, 1.28, 27.4, 6.1, 7.9, 21000.0, format="pytorch", **_generation(0.0, 0.02, 0.1, 0.03, 4.1)),
        "teacher": _model(
            41.2, 1.31, 27.4, 6.1, 7.9, 21000.0, format="pytorch", **_generation(0.19, 0.31, 8.2, 0.29, 2.4)
        ),
        "student": _model(
            52.8, 1.39, 14.1, 3.2, 4.4, 40000.0, format="pytorch", **_generation(0.16, 0.27, 6.9, 0.25, 2.6)
        ),
        "onnx_fp32": _model(52.8, 1.39, 14.3, 1.9, 2.6, 67000.0, format="onnx", answer_loss=2.6),
        "int8_dynamic": _model(53.9, 1.40, 3.8, 1.4, 2.2, 91000.0, format="onnx", answer_loss=2.62),
        "int8_qdq": _model(53.4, 1.40, 3.9, 2.3, 3.1, 55000.0, format="onnx"),
    }
    out = {
        "context": 128,
        "stride": 128,
        "eval_tokens": 16384,
        "eval_bytes": 51200,
        "latency_runs": 20,
        "models": models,
        "served_model": "int8_dynamic",
        "tensorrt": {"status": "skipped", "reason": "no GPU"},
        "production": {
            "status": "found",
            "version": "v20261128-101500",
            "metrics": {"student_bits_per_byte": 1.41, "student_exact_match": 0.16},
        },
        "generation": {
            "status": "evaluated",
            "qa_uri": "demo://chatterbot",
            "heldout_fraction": 0.1,
            "heldout_fraction_source": "the LoRA stage's manifest",
            "prompts": 32,
            "max_new_tokens": 24,
            "bleu_signature": "nrefs:var|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0",
            "samples": [
                {
                    "prompt": "Question: What do you like to do?\nAnswer:",
                    "references": ["I like to count in binary.", "I like to chat with people."],
                    "answers": {"teacher": "I like to chat.", "student": ""},
                },
                {
                    "prompt": f"Question: where is {LONG_URI}?\nAnswer:",
                    "references": ["In the bucket: " + LONG_URI.replace("/", "_")],
                    "answers": {"teacher": LONG_URI, "student": "the bucket the bucket the bucket"},
                },
                {
                    "prompt": "Question: <script>alert(1)</script> 你好?\nAnswer:",
                    "references": ["你好！"],
                    "answers": {"teacher": "你好", "student": "Hello & welcome"},
                },
            ],
        },
        "data": {
            "clean": {
                "input": LONG_URI,
                "metrics": {"docs_in": 769, "docs_out": 737, "bytes_in": 4780000, "bytes_out": 4680000},
                "removed": {"language": 1, "gopher_quality": 5, "c4": 8, "fineweb": 18, "exact_dedup": 0},
            },
            "tokens": {"vocab_size": 2048, "splits": {"train": {"tokens": 1200000, "documents": 700}}},
        },
    }
    decision = check_gate(GateConfig(max_student_perplexity=400.0, max_latency_ms=1000.0), out)
    out["gate"], out["passed"] = decision.to_dict(), decision.passed
    out["headline"] = headline(out)
    return out


HISTORIES = {
    "teacher": {"step": [0, 10, 20, 30], "train_loss": [7.6, 5.1, 4.2, 3.9], "eval_step": [30], "eval_loss": [4.1]},
    "student": {"step": [0, 25, 50], "train_loss": [6.0, 4.4, 4.0], "kd_loss": [2.1, 1.2, 0.9]},
}


@pytest.fixture(scope="module")
def page(results) -> str:
    config = resolve_config("tiny-cpu").model_dump(mode="json")
    return html_report(results, HISTORIES, run_id=RUN_ID, preset="tiny-cpu", config=config)


def test_report_is_self_contained_and_escapes_text(page):
    text = page.replace("<wbr>", "")  # line-break opportunities in paths and signatures
    assert "<script" not in page.replace("&lt;script&gt;", "")  # the prompt's tag is text, not markup
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert not re.search(r"""(src|href)\s*=\s*["'](https?:)?//""", page)  # nothing loaded from elsewhere
    assert "@import" not in page and "<link" not in page and "url(http" not in page
    for heading in SECTIONS:
        assert f"<h2>{heading}</h2>" in page
    assert page.count("data:image/png;base64,") >= 7  # 2 loss curves + 6 comparison charts
    assert "nrefs:var|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0" in text
    assert "v20261128-101500" in text and "skipped: no GPU" in text and "loglikelihood_rolling" in text
    assert "(empty)" in page  # an empty answer is shown as such


def test_report_names_the_run_and_preset_and_holds_the_resolved_config_collapsed(page):
    assert f"<dd><code>{RUN_ID.replace('-', '-<wbr>')}</code></dd>" in page
    assert "<dt>preset</dt><dd><code>tiny-<wbr>cpu</code></dd>" in page
    assert "run lmforge-<wbr>pipeline" in page and "preset tiny-<wbr>cpu · gate passed" in page
    config = page.split("<h2>Configuration</h2>")[1].split("<h2>")[0]
    assert config.startswith(
        "\n<details><summary>Resolved configuration (preset tiny-cpu with the run&#x27;s overrides)"
    )
    assert "pretrain:\n  model:\n    arch: gpt2" in config and "vocab_size: 2048" in config


def test_report_without_run_details_says_so(results):
    page = html_report(results)
    assert "<dt>run id</dt><dd><code>not given</code></dd>" in page
    assert "The resolved configuration was not given to the report." in page


def test_markdown_summary_has_table_gate_and_samples(results):
    md = markdown_summary(results, run_id=RUN_ID, preset="tiny-cpu")
    assert md.startswith(f"# lmforge evaluation: PASSED\n\nRun `{RUN_ID}`, preset `tiny-cpu`.\n")
    assert "| model | status | perplexity | bits/byte | EM (0–1) |" in md
    assert "`bits_per_byte_vs_production`" in md and "BLEU signature: `nrefs:var" in md
    assert "## Generation samples" in md and "student: (empty)" in md
    assert "<script>" not in md and "Question: &lt;script&gt;alert(1)&lt;/script&gt; 你好? Answer:" in md


def _chromium(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    env = {**os.environ, "HOME": str(tmp_path)}
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_report_renders_in_headless_chromium(page, tmp_path):
    path = tmp_path / "report.html"
    path.write_text(page, encoding="utf-8")
    url = path.as_uri()

    dom = _chromium(["--dump-dom", url], tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    for heading in SECTIONS:
        assert f"<h2>{heading}</h2>" in dom.stdout, heading
    assert dom.stdout.count("<img") >= 7 and "PASSED" in dom.stdout

    shot = tmp_path / "report.png"
    run = _chromium([f"--screenshot={shot}", "--window-size=1200,3000", "--hide-scrollbars", url], tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1200, 3000)
    assert len(data) > 50_000  # a rendered page with plots, not a blank one


# Runs at load (after the plots are decoded): the page height as shown, then, with every <details> open, every
# element that reaches past the viewport's right edge, unless it lies inside a box that scrolls by itself, and
# how many of those boxes do scroll.
FIT_PROBE = """
addEventListener("load", () => {
  const root = document.documentElement;
  const fit = {viewport: root.clientWidth, height: root.scrollHeight, overflowing: []};
  document.querySelectorAll("details").forEach((d) => { d.open = true; });
  for (const el of document.body.querySelectorAll("*")) {
    const box = el.parentElement.closest(".scroll");
    const r = el.getBoundingClientRect();
    if (!box && r.width > 0 && (r.right > fit.viewport + 0.5 || r.left < -0.5)) {
      const name = `${el.tagName.toLowerCase()}.${el.className}`;
      fit.overflowing.push(`${name}: ${Math.round(r.left)}..${Math.round(r.right)}`);
    }
  }
  fit.scrollWidth = root.scrollWidth;
  fit.scrolling = [...document.querySelectorAll(".scroll")].filter((b) => b.scrollWidth > b.clientWidth).length;
  const out = document.createElement("pre");
  out.id = "fit";
  out.textContent = JSON.stringify(fit);
  document.body.append(out);
});
"""


def _fit(page: str, width: int, tmp_path: Path) -> dict:
    probe = tmp_path / f"fit-{width}.html"
    probe.write_text(page.replace("</body>", f"<script>{FIT_PROBE}</script></body>"), encoding="utf-8")
    args = [
        f"--window-size={width},1200",
        "--hide-scrollbars",
        "--virtual-time-budget=10000",
        "--dump-dom",
        probe.as_uri(),
    ]
    dom = _chromium(args, tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    found = re.search(r'<pre id="fit">(.*?)</pre>', dom.stdout, re.S)
    assert found, dom.stdout[-2000:]
    return json.loads(html.unescape(found.group(1)))


@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
@pytest.mark.parametrize("width", [1000, 1600])
def test_report_fits_the_window_width_with_nothing_cut_off(page, results, tmp_path, width):
    unbroken = {
        "prompt": "Question: ?",
        "references": ["-"],
        "answers": {"student": "x" * 400},
    }  # wider than any window
    wide = {
        **results,
        "generation": {**results["generation"], "samples": [*results["generation"]["samples"], unbroken]},
    }
    for shown in (html_report(wide, HISTORIES), page):
        fit = _fit(shown, width, tmp_path)
        assert fit["viewport"] == width
        assert fit["overflowing"] == []
        assert fit["scrollWidth"] <= width  # the page itself never scrolls sideways; a wide table scrolls in its box
        assert fit["scrolling"] >= (1 if shown is not page else 0)

    path = tmp_path / "report.html"
    path.write_text(page, encoding="utf-8")
    shot = tmp_path / f"report-{width}.png"
    args = [f"--screenshot={shot}", f"--window-size={width},{fit['height']}", "--hide-scrollbars", path.as_uri()]
    run = _chromium(args, tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    image = Image.open(shot).convert("RGB")
    assert image.size == (width, fit["height"])  # the whole page, top to bottom
    right_edge = {image.getpixel((width - 1, y)) for y in range(image.height)}
    assert right_edge == {(255, 255, 255)}  # page margin all the way down: nothing drawn up to the edge
    if width == 1000 and os.environ.get("LMFORGE_REPORT_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["LMFORGE_REPORT_SCREENSHOT"])


def test_summary_states_the_headline_figures_and_retention(results):
    page = html_report(results, HISTORIES)
    summary = page.split("<h2>Summary</h2>", 1)[1].split("<h2>", 1)[0]
    assert "3% of held-out prompts answered with an empty string" in summary
    assert "answer loss 1.092x the teacher&#x27;s (int8_dynamic)" in summary
    assert "teacher bits/byte on held-out corpus text: 1.023x the base model&#x27;s" in summary
    assert "data retention: cleaning kept 96% of documents, 98% of bytes" in summary
    assert "WARNING" not in summary
    md = markdown_summary(results)
    assert "- data retention: cleaning kept 96% of documents, 98% of bytes" in md


# After load: every table of the model comparison section, whether its scroll box scrolls (part of it hidden),
# its width, and the height in lines of the tallest cell; and whether the first sample prompt keeps its line break.
COMPARISON_PROBE = """
addEventListener("load", () => {
  const heading = [...document.querySelectorAll("h2")].find((h) => h.textContent === "Model comparison");
  const tables = [];
  for (let el = heading.nextElementSibling; el && el.tagName !== "H2"; el = el.nextElementSibling) {
    if (!el.classList.contains("scroll")) continue;
    const cells = [...el.querySelectorAll("td")];
    const line = parseFloat(getComputedStyle(cells[0]).lineHeight);
    tables.push({
      hidden: el.scrollWidth > el.clientWidth,
      width: el.querySelector("table").getBoundingClientRect().width,
      lines: Math.max(...cells.map((c) => Math.round((c.clientHeight - 8) / line))),
    });
  }
  const prompt = [...document.querySelectorAll("td.pre")][0];
  const out = document.createElement("pre");
  out.id = "cmp";
  out.textContent = JSON.stringify({viewport: document.documentElement.clientWidth, tables,
                                    promptHeight: prompt.getClientRects().length && prompt.clientHeight,
                                    lineHeight: parseFloat(getComputedStyle(prompt).lineHeight)});
  document.body.append(out);
});
"""


@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
@pytest.mark.parametrize("width", [1000, 1600])
def test_the_model_comparison_is_fully_visible_and_prompts_keep_line_breaks(results, tmp_path, width):
    long_reason = "no CUDA GPU on this node; TensorRT engines are built on the gpu node pool (nvidia.com/gpu) only"
    shown = {**results, "tensorrt": {"status": "skipped", "reason": long_reason}}
    probe = tmp_path / "cmp.html"
    probe.write_text(html_report(shown, HISTORIES).replace("</body>", f"<script>{COMPARISON_PROBE}</script></body>"))
    args = [f"--window-size={width},1200", "--hide-scrollbars", "--virtual-time-budget=10000", "--dump-dom"]
    dom = _chromium([*args, probe.as_uri()], tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    found = json.loads(html.unescape(re.search(r'<pre id="cmp">(.*?)</pre>', dom.stdout, re.S).group(1)))
    assert found["viewport"] == width and len(found["tables"]) >= 2
    for table in found["tables"]:
        assert not table["hidden"], found  # no column behind a scrollbar
        assert table["width"] <= width
        assert table["lines"] <= 2, found  # the TensorRT status is a word, its reason a note under the table
    section = dom.stdout.split("Model comparison", 1)[1].split("<h2>", 1)[0].replace("<wbr>", "")
    assert long_reason in section  # shown whole, as a note under the tables
    # "Question: …\nAnswer:" renders on two lines
    assert found["promptHeight"] >= 2 * found["lineHeight"]


def test_metric_labels_carry_their_scales(results):
    page = html_report(results, HISTORIES)
    for label in ("BLEU (0–100)", "F1 (0–1)", "EM (0–1)", "ROUGE-L (0–1)"):
        assert label in page
        assert label in markdown_summary(results)
    assert "<th>BLEU</th>" not in page
