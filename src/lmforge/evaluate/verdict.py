"""The verdict in words: one sentence per model saying what it is good for, from the measured numbers.

Rules (each a constant below, each tested):

* Q&A — "answers A of N held-out questions" (A: non-empty answers), then by token F1 (0–1): below
  :data:`F1_SOME` "not useful for answering questions yet", below :data:`F1_GOOD` "answers some questions: check
  the samples before relying on it", else "answers held-out questions well".
* Multiple choice (a harness task whose YAML states its ``chance``) — "picks the right answer in P% of <task>
  questions (chance C%)", and "no better than chance" unless accuracy exceeds chance by more than
  :data:`CHANCE_MARGIN_STDERR` standard errors; "<task> n/a (N of N items skipped: ...)" when the model's context
  fits none of the task's items.
* Held-out corpus text — against the base model's bits per byte: within :data:`BPB_SAME` "models held-out text as
  well as the base", else "X% better/worse than the base"; the base itself states its bits per byte.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmforge.evaluate.harness import all_skipped

F1_SOME = 0.3
F1_GOOD = 0.6
CHANCE_MARGIN_STDERR = 2.0
BPB_SAME = 0.02
VERDICT_MODELS = ("base", "teacher", "student")


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def qa_phrase(entry: Mapping[str, Any]) -> str | None:
    """What the model's answers to the held-out questions are good for; ``None`` when it did not answer any."""
    gen = entry.get("generation")
    f1 = _num(entry.get("f1"))
    if not isinstance(gen, Mapping) or f1 is None or not gen.get("prompts"):
        return None
    prompts = int(gen["prompts"])
    answered = prompts - int(gen.get("empty_predictions") or 0)
    figures = f"answers {answered} of {prompts} held-out questions"
    if f1 < F1_SOME:
        return f"{figures}, but F1 {f1:.2f} (0–1): not useful for answering questions yet"
    if f1 < F1_GOOD:
        return f"{figures} with F1 {f1:.2f} (0–1): answers some questions, check the samples before relying on it"
    return f"{figures} with F1 {f1:.2f} (0–1): answers held-out questions well"


def choice_phrases(model: str, harness: Mapping[str, Any]) -> list[str]:
    """One phrase per multiple-choice harness task with a stated chance level."""
    phrases = []
    for task, info in (harness.get("tasks") or {}).items():
        chance = _num(info.get("chance"))
        scores = ((harness.get("scores") or {}).get(model) or {}).get(task) or {}
        acc, stderr = _num(scores.get("acc")), _num(scores.get("acc_stderr")) or 0.0
        if chance is not None and acc is None and (note := all_skipped(harness, model, task)):
            phrases.append(f"{task} n/a ({note})")
        if chance is None or acc is None:
            continue
        text = f"picks the right answer in {acc:.0%} of {task} questions (chance {chance:.0%})"
        if acc - chance <= CHANCE_MARGIN_STDERR * stderr:
            text += ", no better than chance"
        phrases.append(text)
    return phrases


def text_phrase(model: str, models: Mapping[str, Any]) -> str | None:
    """Held-out corpus text: bits per byte against the base model's."""
    bpb = _num((models.get(model) or {}).get("bits_per_byte"))
    base = _num((models.get("base") or {}).get("bits_per_byte"))
    if bpb is None:
        return None
    if model == "base" or base is None or base <= 0:
        return f"{bpb:.3f} bits per byte on held-out corpus text"
    change = (bpb - base) / base
    if abs(change) <= BPB_SAME:
        return "models held-out corpus text as well as the base"
    return f"models held-out corpus text {abs(change):.0%} {'worse' if change > 0 else 'better'} than the base"


def model_verdict(model: str, results: Mapping[str, Any]) -> str | None:
    """One sentence about ``model``; ``None`` when it has no figures to speak of."""
    models = results.get("models") or {}
    entry = models.get(model)
    if not entry:
        return None
    parts = [p for p in (qa_phrase(entry), *choice_phrases(model, results.get("harness") or {})) if p]
    parts += [p for p in (text_phrase(model, models),) if p]
    if not parts:
        return None
    return f"{model}: " + "; ".join(parts) + "."


def verdict_lines(results: Mapping[str, Any]) -> list[str]:
    """A sentence per model (base, teacher, student, then the served model where it answered questions itself)."""
    names = list(VERDICT_MODELS)
    served = results.get("served_model")
    if served and served not in names and (results.get("models") or {}).get(served, {}).get("generation"):
        names.append(served)
    lines = []
    for name in names:
        if line := model_verdict(name, results):
            lines.append(line.replace(f"{name}:", f"{name} (served):", 1) if name == served else line)
    return lines
