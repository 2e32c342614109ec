"""The data of the lm-evaluation-harness tasks that ship with lmforge (``lmforge/evaluate/tasks``), built from the
demo corpora (the ``demo`` extra) so that the demo and the tests run real harness tasks with no hub.

* ``lmforge_qa_mc`` — multiple choice: each held-out ``demo://chatterbot`` prompt (the prompt-hash split LoRA never
  trains on, :data:`~lmforge.contracts.QA_HELDOUT_FRACTION`) with its first reference answer and
  :data:`DISTRACTORS` answers of other held-out prompts, in the fine-tuning prompt template. Chance: 1 in 4.
  Answers longer than :data:`MAX_ANSWER_CHARS` are left out, so that every choice fits a small model's context.
* ``lmforge_cloze`` — last-word prediction (LAMBADA-style loglikelihood): passages of ``demo://shakespeare``
  scenes that the ``tokenize`` stage holds out (split bucket below :data:`CLOZE_VAL_FRACTION`, the tiny-cpu
  preset's ``val_fraction``), the passage's last word as the target.

:func:`build_task_data` writes both JSONL files; the shipped files are its output (a test rebuilds and compares).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

from lmforge.contracts import QA_HELDOUT_FRACTION

TASKS_DIR = Path(__file__).with_name("tasks")
"""The packaged task YAML files and their JSONL data."""
DISTRACTORS = 3
MAX_ANSWER_CHARS = 120
CLOZE_VAL_FRACTION = 0.05
CLOZE_PER_SCENE = 2
CLOZE_CONTEXT_LINES = 3
_SEED = 20261202
_WORD = re.compile(r"^(.*\S)\s+([A-Za-z][A-Za-z']*)[^A-Za-z']*$", re.S)


def qa_multiple_choice() -> Iterator[dict[str, object]]:
    """Multiple-choice items ``{"question", "choices", "label"}`` from the held-out chatterbot prompts."""
    from lmforge.data.demo import chatterbot_pairs
    from lmforge.data.qa import is_heldout

    answers: dict[str, str] = {}
    for pair in chatterbot_pairs():
        if is_heldout(pair["prompt"], QA_HELDOUT_FRACTION) and len(pair["response"]) <= MAX_ANSWER_CHARS:
            answers.setdefault(pair["prompt"], pair["response"])
    rng = random.Random(_SEED)
    prompts = list(answers)
    for prompt in prompts:
        others = sorted({answers[p] for p in prompts if p != prompt and answers[p] != answers[prompt]})
        choices = [answers[prompt], *rng.sample(others, DISTRACTORS)]
        rng.shuffle(choices)
        yield {"question": prompt, "choices": choices, "label": choices.index(answers[prompt])}


def shakespeare_cloze() -> Iterator[dict[str, str]]:
    """Cloze items ``{"context", "target", "source"}``: a held-out scene's lines, the last one without its last word
    (the target, with its leading space and without trailing punctuation)."""
    from lmforge.contracts import split_bucket
    from lmforge.data.demo import shakespeare_documents

    for doc in shakespeare_documents():
        if split_bucket(doc["id"]) >= CLOZE_VAL_FRACTION:
            continue
        lines = doc["text"].split("\n")
        ends = [i for i, line in enumerate(lines) if i >= CLOZE_CONTEXT_LINES and len(line.split()) >= 8]
        for end in ends[:: max(len(ends) // CLOZE_PER_SCENE, 1)][:CLOZE_PER_SCENE]:
            match = _WORD.match(lines[end])
            if match is None:
                continue
            context = "\n".join([*lines[end - CLOZE_CONTEXT_LINES : end], match.group(1)])
            yield {"context": context, "target": " " + match.group(2), "source": doc["source"]}


def build_task_data(out_dir: Path = TASKS_DIR) -> list[Path]:
    """Write ``lmforge_qa_mc.jsonl`` and ``lmforge_cloze.jsonl`` under ``out_dir``; return their paths."""
    written = []
    for name, items in (("lmforge_qa_mc", qa_multiple_choice()), ("lmforge_cloze", shakespeare_cloze())):
        path = Path(out_dir, f"{name}.jsonl")
        path.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items), encoding="utf-8")
        written.append(path)
    return written
