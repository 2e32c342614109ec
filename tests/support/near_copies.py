"""Near copies of a text for dedup tests and benchmarks: words deleted, substituted and inserted at random."""

from __future__ import annotations

import random
from collections.abc import Sequence


def edit_words(text: str, rate: float, rng: random.Random, vocab: Sequence[str]) -> str:
    """``text`` with each space-separated word deleted, substituted or followed by an inserted word (drawn from
    ``vocab``), each with chance ``rate / 3``."""
    out: list[str] = []
    for word in text.split(" "):
        r = rng.random()
        if r < rate / 3:
            continue
        if r < 2 * rate / 3:
            out.append(rng.choice(vocab))
            continue
        out.append(word)
        if r < rate:
            out.append(rng.choice(vocab))
    return " ".join(out)
