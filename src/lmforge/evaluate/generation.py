"""Generation quality on the held-out Q&A pairs: greedy answers scored by EM, token F1, BLEU and ROUGE-L.

Held-out set: :func:`lmforge.data.qa.split_examples` with the fine-tuning stage's ``heldout_fraction``,
so the prompts are ones LoRA never trained on. A prompt/response pair is asked with the documented
template (:data:`lmforge.data.qa.PROMPT_TEMPLATE`); a chat is asked with everything before its last
assistant answer, rendered as LoRA rendered it (:func:`lmforge.data.qa.render_segments`), and that answer
is the reference. Examples are grouped by prompt; all responses to a prompt are its references, and every
metric takes the best reference per prompt (as SQuAD does), except corpus BLEU, which uses them all as
multiple references.

Generation: greedy decoding
with the KV cache (Hugging Face ``generate``, ``do_sample=False``) in batches with left padding, stopped
at EOS or ``max_new_tokens``; the answer is the decoded continuation, cut at the first newline when
configured, stripped. Greedy decoding is deterministic; the seed is set anyway so that nothing random
(dropout left on by mistake, a sampling default) can change the numbers between runs.

Metrics:
- exact match and token F1 after SQuAD normalization (:func:`normalize_answer`: lower case, ASCII
  punctuation removed, articles a/an/the removed, whitespace collapsed), SQuAD v2 rule for empty
  answers (F1 is 1 when both sides normalize to nothing, else 0);
- corpus BLEU by sacrebleu; its signature (tokenizer, smoothing, version) is reported with the score;
- ROUGE-L F-measure by rouge-score with Porter stemming. rouge-score's default tokenizer deletes every
  non-ASCII character (a Chinese answer scores 0 against itself), so :class:`UnicodeRougeTokenizer` is
  passed: identical to the default on ASCII text, it keeps Unicode letters and digits and splits CJK
  text into characters.
"""

from __future__ import annotations

import logging
import re
import string
import unicodedata
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmforge import contracts

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from lmforge.data.qa import Example
    from lmforge.onnx_runtime import OrtDecoderWithPast

log = logging.getLogger("lmforge.evaluate")

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalization: lower case, no ASCII punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when both normalize to the same string, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(reference))


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD token F1 over normalized whitespace tokens; 1.0 if both are empty, 0.0 if one is."""
    pred = normalize_answer(prediction).split()
    ref = normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def _is_cjk(ch: str) -> bool:
    return unicodedata.name(ch, "").startswith(("CJK ", "HIRAGANA", "KATAKANA", "HANGUL"))


class UnicodeRougeTokenizer:
    """rouge-score's tokenization (lower case, runs of letters/digits, Porter stem on tokens > 3 chars),
    but Unicode-aware: non-ASCII letters are kept and CJK characters become one token each."""

    def __init__(self, use_stemmer: bool = True) -> None:
        from nltk.stem import porter

        self._stemmer = porter.PorterStemmer() if use_stemmer else None

    def tokenize(self, text: str) -> list[str]:
        """Tokens of ``text`` as rouge-score would count them."""
        spaced = "".join(f" {ch} " if _is_cjk(ch) else ch for ch in text.lower())
        tokens = re.findall(r"[^\W_]+", spaced, flags=re.UNICODE)
        if self._stemmer is not None:
            tokens = [self._stemmer.stem(t) if len(t) > 3 and t.isascii() else t for t in tokens]
        return tokens


@dataclass(frozen=True)
class GenerationScores:
    """Corpus figures over the held-out prompts (EM, F1, ROUGE-L as fractions; BLEU 0-100)."""

    prompts: int
    exact_match: float
    f1: float
    bleu: float
    bleu_signature: str
    rouge_l: float
    empty_predictions: int


def score_predictions(
    predictions: Sequence[str], references: Sequence[Sequence[str]], *, bleu_tokenize: str = "13a"
) -> GenerationScores:
    """Score one prediction per prompt against that prompt's references.

    Args:
        predictions: one answer per prompt (may be empty).
        references: the non-empty list of reference answers of each prompt.
        bleu_tokenize: sacrebleu tokenizer (``13a``, ``intl``, ``zh``, ``char``, ``none``).
    """
    from rouge_score import rouge_scorer
    from sacrebleu.metrics import BLEU

    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} reference lists")
    if not predictions:
        raise ValueError("no predictions to score")
    if any(not refs for refs in references):
        raise ValueError("every prompt needs at least one reference")
    em = [max(exact_match(p, r) for r in refs) for p, refs in zip(predictions, references, strict=True)]
    f1 = [max(token_f1(p, r) for r in refs) for p, refs in zip(predictions, references, strict=True)]
    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=UnicodeRougeTokenizer(use_stemmer=True))
    rouge = [
        scorer.score_multi(list(refs), p)["rougeL"].fmeasure for p, refs in zip(predictions, references, strict=True)
    ]
    # sacrebleu takes reference *streams*; prompts with fewer references are padded with None.
    width = max(len(refs) for refs in references)
    streams = [[refs[i] if i < len(refs) else None for refs in references] for i in range(width)]
    bleu = BLEU(tokenize=bleu_tokenize)
    corpus = bleu.corpus_score(list(predictions), streams)
    n = len(predictions)
    return GenerationScores(
        prompts=n,
        exact_match=sum(em) / n,
        f1=sum(f1) / n,
        bleu=float(corpus.score),
        bleu_signature=str(bleu.get_signature()),
        rouge_l=sum(rouge) / n,
        empty_predictions=sum(1 for p in predictions if not p.strip()),
    )


def prompt_and_reference(
    example: Example, tokenizer: PreTrainedTokenizerBase, chat_template: str = "auto"
) -> tuple[str, str]:
    """The text a model is asked (templated as in fine-tuning) and the reference answer."""
    from lmforge.data.qa import QAPair, render_segments

    if isinstance(example, QAPair):
        return example.prompt_text(), example.response
    segments = render_segments(example, tokenizer, chat_template)
    last = max(i for i, s in enumerate(segments) if s.scored)
    answer = next(content for role, content in reversed(example.messages) if role == "assistant" and content)
    return "".join(s.text for s in segments[:last]), answer


def group_by_prompt(pairs: Sequence[tuple[str, str]], max_prompts: int | None = None) -> list[tuple[str, list[str]]]:
    """``(prompt, [references])`` from ``(prompt, reference)`` pairs, first-seen order, at most ``max_prompts``."""
    grouped: dict[str, list[str]] = {}
    for prompt, reference in pairs:
        if prompt not in grouped and max_prompts is not None and len(grouped) >= max_prompts:
            continue
        grouped.setdefault(prompt, []).append(reference)
    return list(grouped.items())


def clean_answer(text: str, *, stop_at_newline: bool) -> str:
    """The answer in a decoded continuation: up to the first newline (when asked), stripped."""
    if stop_at_newline:
        text = text.split("\n", 1)[0]
    return text.strip()


def _greedy_new_tokens(
    model: PreTrainedModel | OrtDecoderWithPast,
    tokenizer: PreTrainedTokenizerBase,
    batch: list[str],
    *,
    max_new_tokens: int,
    max_length: int | None,
) -> Any:
    """The greedy continuations of one left-padded batch: PyTorch ``generate``, or the ONNX KV-cache decoder."""
    from lmforge.onnx_runtime import OrtDecoderWithPast

    truncation = max_length is not None
    if isinstance(model, OrtDecoderWithPast):
        enc = tokenizer(batch, return_tensors="np", padding=True, truncation=truncation, max_length=max_length)
        return model.generate(
            enc["input_ids"],
            enc["attention_mask"],
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    import torch

    enc = tokenizer(batch, return_tensors="pt", padding=True, truncation=truncation, max_length=max_length)
    enc = enc.to(next(model.parameters()).device)
    with torch.inference_mode():
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            use_cache=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    return out[:, enc["input_ids"].shape[1] :]


def generate_answers(
    model: PreTrainedModel | OrtDecoderWithPast,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    batch_size: int,
    stop_at_newline: bool = True,
    seed: int = 0,
    max_positions: int | None = None,
) -> list[str]:
    """Greedy answers to ``prompts`` (already templated), batched with left padding and the KV cache.

    ``model`` is a PyTorch causal LM or an exported model's ONNX KV-cache decoder (the served model); the
    latter needs ``max_positions`` (the model's context) to keep prompt and answer within it.
    """
    import torch

    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no padding token; batched generation needs one")
    config = getattr(model, "config", None)  # a PyTorch model's; the ONNX decoder's comes as max_positions
    positions = max_positions or (contracts.max_positions(config.to_dict()) if config is not None else None)
    max_length = positions - max_new_tokens if positions else None
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) leaves no room in the model's {positions} positions")
    sides = tokenizer.padding_side, tokenizer.truncation_side
    # Left padding keeps every prompt's last token at the end of the batch; left truncation keeps the end
    # of an over-long prompt, where "Answer:" is.
    tokenizer.padding_side, tokenizer.truncation_side = "left", "left"
    answers: list[str] = []
    try:
        torch.manual_seed(seed)
        for i in range(0, len(prompts), batch_size):
            batch = list(prompts[i : i + batch_size])
            new = _greedy_new_tokens(model, tokenizer, batch, max_new_tokens=max_new_tokens, max_length=max_length)
            texts = tokenizer.batch_decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            answers.extend(clean_answer(t, stop_at_newline=stop_at_newline) for t in texts)
    finally:
        tokenizer.padding_side, tokenizer.truncation_side = sides
    return answers


def evaluate_generation(
    model: PreTrainedModel | OrtDecoderWithPast,
    tokenizer: PreTrainedTokenizerBase,
    groups: Sequence[tuple[str, Sequence[str]]],
    *,
    max_new_tokens: int,
    batch_size: int,
    stop_at_newline: bool,
    bleu_tokenize: str,
    seed: int,
    max_positions: int | None = None,
) -> tuple[GenerationScores, list[str]]:
    """Generate an answer to every grouped (templated) prompt and score it; returns the scores and answers."""
    prompts = [prompt for prompt, _ in groups]
    answers = generate_answers(
        model,
        tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        stop_at_newline=stop_at_newline,
        seed=seed,
        max_positions=max_positions,
    )
    scores = score_predictions(answers, [list(refs) for _, refs in groups], bleu_tokenize=bleu_tokenize)
    return scores, answers


def samples(
    groups: Sequence[tuple[str, Sequence[str]]], answers: Mapping[str, Sequence[str]], count: int
) -> list[dict[str, Any]]:
    """The first ``count`` prompts with their references and every model's answer (for the report)."""
    return [
        {"prompt": prompt, "references": list(refs), "answers": {m: a[i] for m, a in answers.items()}}
        for i, (prompt, refs) in enumerate(groups[:count])
    ]
