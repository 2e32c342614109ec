"""The benchmarks' shared helpers: tables laid out as the scripts print them, and the JSON record they write."""

from __future__ import annotations

import json
import os

import pytest

from bench import common
from lmforge.cpus import cgroup_cpu_limit


def test_text_table_pads_to_the_widest_cell_left_then_right_with_floats_to_three_digits():
    table = common.text_table(["run", "docs", "wall s"], [["ours", 36, 1.95123], ["datatrove, workers=1", 5, 12.0]])
    assert table.splitlines() == [
        "run                   docs  wall s",
        "ours                    36    1.95",
        "datatrove, workers=1     5      12",
    ]


def test_text_table_with_fixed_widths_reproduces_an_f_string_layout():
    row = ("tiny-cpu", "cpu", 2, "fp32", "off", "1234", "12.5%", "4.321")
    header = ("model", "device", "ranks", "prec", "gc", "tokens/s", "MFU", "loss")
    table = common.text_table(header, [row], widths=[10, 14, 5, 5, 5, 10, 7, 7], align="<<>>>>>>", sep=" ", rule=True)
    head = f"{'model':<10} {'device':<14} {'ranks':>5} {'prec':>5} {'gc':>5} {'tokens/s':>10} {'MFU':>7} {'loss':>7}"
    line = f"{'tiny-cpu':<10} {'cpu':<14} {2:>5} {'fp32':>5} {'off':>5} {1234:>10.0f} {12.5:>6.1f}% {4.321:>7.3f}"
    assert table.splitlines() == [head, "-" * len(head), line]


def test_markdown_table_has_a_separator_row_per_column():
    assert common.markdown_table(["runtime", "p50 / p99 ms"], [["onnx", "1.00 / 2.00"], ["int8", 0.5]]) == (
        "| runtime | p50 / p99 ms |\n|---|---|\n| onnx | 1.00 / 2.00 |\n| int8 | 0.5 |"
    )


def test_machine_facts_name_this_machine():
    facts = common.machine_facts()
    assert facts["cpus"] == os.cpu_count() and facts["cpu_limit"] == cgroup_cpu_limit()
    assert len(facts["load_average"]) == 3 and all(isinstance(x, float) for x in facts["load_average"])
    assert facts["cpu_model"] and facts["torch"] != "not installed"


@pytest.mark.parametrize(
    ("v2", "v1", "expected"),
    [("max", None, None), ("1073741824", None, 1.0), (None, "9223372036854771712", None), (None, "536870912", 0.5)],
)
def test_memory_limit_reads_cgroup_v2_then_v1_and_no_limit_is_none(tmp_path, monkeypatch, v2, v1, expected):
    paths = (tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes")
    for path, text in zip(paths, (v2, v1), strict=True):
        if text is not None:
            path.write_text(text + "\n")
    monkeypatch.setattr(common, "_MEMORY_LIMITS", paths)
    assert common._memory_limit_gb() == expected


def test_write_results_records_the_machine_with_the_payload_and_merges_sections(tmp_path):
    path = tmp_path / "out" / "bench.json"
    machine = {"date": "2026-12-01", "cpus": 2}
    assert common.write_results("bench", {"lora": {"x": 1}}, path=path, machine=machine) == path
    assert json.loads(path.read_text()) == {"machine": machine, "lora": {"x": 1}}
    common.write_results("bench", {"kd": {"y": 2}}, path=path, machine={"cpus": 4}, merge=True)
    assert json.loads(path.read_text()) == {"machine": {"cpus": 4}, "lora": {"x": 1}, "kd": {"y": 2}}
    common.write_results("bench", {"kd": {"y": 3}}, path=path, machine=machine)
    assert json.loads(path.read_text()) == {"machine": machine, "kd": {"y": 3}}
    with pytest.raises(ValueError, match="'machine' key"):
        common.write_results("bench", {"machine": "x"}, path=path)


def test_results_go_to_bench_results_by_name():
    assert common.result_path("data_bench") == common.RESULTS / "data_bench.json"
    assert common.RESULTS.name == "results" and (common.RESULTS / "data_bench.json").is_file()
