"""docs/your-data.md stays true: its Q&A examples parse, its template and formats are the code's, its presets table
lists every preset with the parameter count the preset builds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmforge.config import list_presets
from lmforge.data.corpus import SUFFIXES
from lmforge.data.qa import PROMPT_TEMPLATE, Chat, QAPair, load_examples
from lmforge.model.build import hf_config
from lmforge.stages import resolve_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "your-data.md"
TEXT = DOC.read_text(encoding="utf-8")


def test_the_qa_examples_of_the_doc_are_valid_examples(tmp_path):
    block = re.search(r"```json\n(.*?)```", TEXT, re.S)
    assert block, "docs/your-data.md has no json block"
    path = tmp_path / "qa.jsonl"
    path.write_text(block.group(1), encoding="utf-8")
    assert [type(e) for e in load_examples(str(path))] == [QAPair, Chat]


def test_the_doc_states_the_prompt_template_and_every_corpus_format():
    shown = PROMPT_TEMPLATE.replace("\n", "\\n")  # as the doc writes it: a backslash and an n
    assert f'`"{shown}"`' in TEXT
    for suffix in SUFFIXES:
        assert f"`{suffix}`" in TEXT, suffix


def _size(n: int) -> str:
    return f"{n / 1e9:.3g} B" if n >= 1e9 else f"{n / 1e6:.3g} M"


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_is_in_the_table_with_its_parameter_count(name):
    row = next((line for line in TEXT.splitlines() if line.startswith(f"| `{name}` |")), None)
    assert row, f"docs/your-data.md: no row for preset {name}"
    cfg = resolve_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            hf_config(cfg.pretrain.model, cfg.tokenize.vocab_size, eos_id=0, pad_id=1)
        )
    params = sum(p.numel() for p in model.parameters())
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[2] == _size(params)
    assert cells[3] == str(cfg.pretrain.model.block_size)
