"""Which lm-evaluation-harness items fit a model's context, decided before the harness runs them.

lm-evaluation-harness scores a ``(context, continuation)`` request of a causal model on the last
``max_length + 1`` tokens of context + continuation (the context is cut from the left, the last token only a target),
and asserts first that the continuation alone has at most ``max_length`` tokens
(``HFLM._loglikelihood_tokens`` in lm_eval/models/huggingface.py: ``assert len(continuation_enc) <=
self.max_length``). A multiple-choice answer or a cloze target longer than a small model's context therefore stops
the whole evaluation. :func:`fitting_documents` finds the documents whose every loglikelihood continuation fits,
tokenized by the harness's own ``loglikelihood`` (so its rules hold: trailing spaces of the context move to the
continuation, the continuation is what the whole text adds to the context's tokens, an empty context becomes the
prefix token); the caller hands only those to ``simple_evaluate`` and reports the rest as skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

LOGLIKELIHOOD = "loglikelihood"
"""The request type that carries a ``(context, continuation)`` pair (multiple-choice and loglikelihood tasks)."""


def skip_reason(context: int) -> str:
    """Why an item was skipped, as the log, the results and the report say it."""
    return f"continuation longer than the model's context of {context} tokens"


def continuation_lengths(lm: Any, requests: Sequence[Any]) -> list[int]:
    """Tokens of each loglikelihood request's continuation as the harness's ``lm.loglikelihood`` encodes it.

    The model is not run: for this one call the ``_loglikelihood_tokens`` step that ``loglikelihood`` hands its
    encoded requests to is replaced by one that records their continuations' lengths.
    """
    lengths: list[int] = []

    def record(encoded: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        lengths.extend(len(continuation) for _, _, continuation in encoded)
        return [(0.0, False)] * len(encoded)

    lm._loglikelihood_tokens = record
    try:
        lm.loglikelihood(list(requests), disable_tqdm=True)
    finally:
        del lm._loglikelihood_tokens
    return lengths


def set_num_fewshot(task: Any, num_fewshot: int | None) -> None:
    """The few-shot override ``lm_eval.simple_evaluate`` applies to each task (lm_eval/evaluator.py): ``num_fewshot``
    unless the task's YAML pins 0; without one a task with no default gets 0."""
    if num_fewshot is not None:
        if task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
    elif task.get_config("num_fewshot") is None:
        task.set_config(key="num_fewshot", value=0)


def fitting_documents(lm: Any, task: Any, limit: int | None) -> tuple[list[int], int]:
    """Ids of the task's documents (the first ``limit``, as the harness takes them) whose every loglikelihood
    continuation fits ``lm.max_length`` tokens, and how many documents there were.

    Documents of other request types (generation, rolling loglikelihood) always fit: the harness truncates or
    windows those itself.
    """
    total = len(task.eval_docs) if limit is None else min(limit, len(task.eval_docs))
    if total == 0:
        return [], 0
    task.build_all_requests(limit=total, rank=0, world_size=1)
    requests = [r for r in task.instances if r.request_type == LOGLIKELIHOOD]
    too_long = {
        r.doc_id for r, n in zip(requests, continuation_lengths(lm, requests), strict=True) if n > lm.max_length
    }
    return [doc for doc in range(total) if doc not in too_long], total
