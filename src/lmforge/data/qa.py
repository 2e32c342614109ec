"""Question/answer and chat data for fine-tuning.

Input is JSONL (local, ``s3://`` or a ``demo://`` corpus), one example per line, either

* ``{"prompt": "...", "response": "..."}``, rendered with :data:`PROMPT_TEMPLATE`
  (``"Question: {prompt}\\nAnswer:"``) and the response after a space, then EOS; or
* ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}``, rendered through the
  tokenizer's chat template when it has one, else through the default template documented at
  :func:`default_chat_segments`.

An example is rendered into :class:`Segment` s of text, each marked scored or not: only assistant answers
(with their end-of-turn marker) are scored, everything else is masked from the loss. Segments are tokenized
separately so that the boundary between prompt and answer is exact.

The split into train and held-out examples is by a hash of the prompt side of an example, so every stage
that calls :func:`split_examples` with the same fraction gets the same held-out set, and all answers to one
question fall on the same side.

An example too long for the training sequence may be split along the sentences of its final answer
(:func:`encode_examples`): each part keeps the whole prompt and answers with a run of whole sentences.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from lmforge import storage
from lmforge.artifacts import MANIFEST, read_json_file
from lmforge.config import MIN_CHUNK_TOKENS, ChunkLang
from lmforge.data.chunking import SentenceChunker
from lmforge.data.corpus import field_list
from lmforge.data.demo import is_demo, materialize
from lmforge.data.jsonl import DEFAULT_MAX_RECORD_BYTES, BadLine, iter_json_lines
from lmforge.errors import InputDataError

PROMPT_TEMPLATE = "Question: {prompt}\nAnswer:"
ROLES = ("system", "user", "assistant")
IGNORE_INDEX = -100  # the label of a position not scored (PyTorch's cross-entropy default)
_SYNONYMS = {
    **dict.fromkeys(("question", "query", "instruction", "input", "q"), "prompt"),
    **dict.fromkeys(("answer", "output", "completion", "target", "a"), "response"),
}  # field names other Q&A formats use, for the hint of a record without prompt/response

Encoded = tuple[list[int], list[int]]


@dataclass(frozen=True)
class Segment:
    """A piece of rendered text and whether its tokens are scored by the loss."""

    text: str
    scored: bool


@dataclass(frozen=True)
class QAPair:
    """One prompt and its reference response."""

    prompt: str
    response: str

    @property
    def key(self) -> str:
        """What decides the held-out split: the prompt."""
        return self.prompt

    def prompt_text(self) -> str:
        """The prompt as the model sees it (the documented default template)."""
        return PROMPT_TEMPLATE.format(prompt=self.prompt)

    def response_text(self, eos_token: str) -> str:
        """The target continuation: a leading space, the response, then EOS."""
        return f" {self.response}{eos_token}"


@dataclass(frozen=True)
class Chat:
    """A conversation: ``(role, content)`` messages with at least one assistant answer."""

    messages: tuple[tuple[str, str], ...]

    @property
    def key(self) -> str:
        """What decides the held-out split: every non-assistant message."""
        return json.dumps([m for m in self.messages if m[0] != "assistant"])

    def as_dicts(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


Example = QAPair | Chat


def load_examples(
    uri: str, *, max_line_bytes: int = DEFAULT_MAX_RECORD_BYTES, limit: int | None = None
) -> list[Example]:
    """Read the examples of a JSONL file (local, ``s3://`` or ``demo://``): all of them, or the first ``limit``.

    The first bad line (longer than ``max_line_bytes``, not UTF-8, not JSON, or not an example) raises
    :class:`InputDataError` naming ``file:line``. A UTF-8 byte order mark at the start is accepted.
    """
    with tempfile.TemporaryDirectory(prefix="lmforge-qa-") as workdir:
        path = materialize(uri, workdir) if is_demo(uri) else storage.localize(uri, workdir)
        if path.is_dir():
            raise InputDataError(f"Q&A data {uri}: expected a JSONL file, got a directory")
        examples = list(itertools.islice(_parse_jsonl(path, uri, max_line_bytes), limit))
    if not examples:
        raise InputDataError(f"Q&A data {uri}: no examples (the file is empty)")
    return examples


def _parse_jsonl(path: Path, name: str, max_line_bytes: int) -> Iterator[Example]:
    with open(path, "rb") as fh:
        for lineno, record in iter_json_lines(fh, max_bytes=max_line_bytes):
            if isinstance(record, BadLine):
                raise InputDataError(f"{name}:{lineno}: {record.problem}")
            if not isinstance(record, dict):
                raise InputDataError(f"{name}:{lineno}: expected a JSON object")
            yield _parse_record(record, f"{name}:{lineno}")


def _parse_record(record: dict, where: str) -> Example:
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise InputDataError(f"{where}: 'messages' must be a non-empty list")
        parsed = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise InputDataError(f"{where}: messages[{i}] is not an object")
            role, content = message.get("role"), message.get("content")
            if role not in ROLES:
                raise InputDataError(f"{where}: messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
            if not isinstance(content, str):
                raise InputDataError(f"{where}: messages[{i}].content missing or not a string")
            parsed.append((role, content.strip()))
        if not any(role == "assistant" and content for role, content in parsed):
            raise InputDataError(f"{where}: 'messages' has no non-empty assistant message to learn from")
        return Chat(tuple(parsed))
    missing = [field for field in ("prompt", "response") if field not in record]
    if missing:
        raise InputDataError(f"{where}: no {'/'.join(map(repr, missing))} field; {_schema_hint(record)}")
    for field in ("prompt", "response"):
        if not isinstance(record[field], str) or not record[field].strip():
            raise InputDataError(f"{where}: field {field!r} is not a non-empty string")
    return QAPair(record["prompt"].strip(), record["response"].strip())


def _schema_hint(record: dict) -> str:
    """What a record has and what an example needs, naming the renames for common Q&A field names."""
    fields = [str(f) for f in record]
    renames = [f"{f} → {target}" for f in fields if (target := _SYNONYMS.get(f.lower()))]
    rename = f" (rename {', '.join(renames)})" if renames else ""
    return (
        f'the record has {field_list(fields, len(fields))}; each line needs {{"prompt": ..., "response": ...}}{rename} '
        'or {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}'
    )


def is_heldout(key: str, fraction: float) -> bool:
    """Deterministic membership of a prompt (or example key) in the held-out split."""
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    return bucket < fraction


def split_examples(examples: list[Example], heldout_fraction: float) -> tuple[list[Example], list[Example]]:
    """``(train, heldout)`` by hash of each example's key; raises if either side ends up empty."""
    train = [e for e in examples if not is_heldout(e.key, heldout_fraction)]
    heldout = [e for e in examples if is_heldout(e.key, heldout_fraction)]
    if not train or not heldout:
        raise InputDataError(
            f"Q&A split with heldout_fraction={heldout_fraction} leaves {len(train)} train and "
            f"{len(heldout)} held-out examples; need at least one of each"
        )
    return train, heldout


@dataclass(frozen=True)
class QALineage:
    """What the fine-tuning stage recorded in a tuned model's manifest about the Q&A data and how it used it."""

    uri: str | None
    heldout_fraction: float | None
    chat_template: str = "auto"
    split_long_examples: bool = True
    split_lang: str = "auto"


def qa_lineage(model_dirs: Iterable[str | Path]) -> QALineage:
    """The first recorded Q&A lineage (``inputs.qa.uri`` and ``config.heldout_fraction`` both present) among the
    manifests of ``model_dirs``; ``QALineage(None, None)`` when none has one."""
    for model_dir in model_dirs:
        path = Path(model_dir, MANIFEST)
        manifest = read_json_file(path) if path.is_file() else {}
        qa = (manifest.get("inputs") or {}).get("qa") if isinstance(manifest, dict) else None
        config = (manifest.get("config") or {}) if isinstance(manifest, dict) else {}
        fraction = config.get("heldout_fraction")
        if isinstance(qa, dict) and isinstance(fraction, int | float) and not isinstance(fraction, bool):
            return QALineage(
                uri=qa.get("uri"),
                heldout_fraction=float(fraction),
                chat_template=str(config.get("chat_template") or "auto"),
                split_long_examples=bool(config.get("split_long_examples", True)),
                split_lang=str(config.get("split_lang") or "auto"),
            )
    return QALineage(None, None)


def default_chat_segments(chat: Chat, eos_token: str) -> list[Segment]:
    """The default chat template, for tokenizers without one.

    Each message becomes one line: ``"System: {content}\\n"``, ``"User: {content}\\n"``, and for the
    assistant ``"Assistant:"`` (not scored) followed by ``" {content}{eos}"`` (scored) and ``"\\n"``. A
    single user/assistant exchange therefore reads ``"User: hi\\nAssistant: hello<eos>"``; at inference
    the prompt ends with ``"Assistant:"``.
    """
    segments: list[Segment] = []
    for i, (role, content) in enumerate(chat.messages):
        if role == "assistant":
            segments += [Segment("Assistant:", False), Segment(f" {content}{eos_token}", True)]
            if i + 1 < len(chat.messages):
                segments.append(Segment("\n", False))
        else:
            segments.append(Segment(f"{role.capitalize()}: {content}\n", False))
    return segments


def template_chat_segments(chat: Chat, tokenizer: PreTrainedTokenizerBase) -> list[Segment]:
    """Segments of a conversation rendered with the tokenizer's chat template.

    Each assistant answer is the text the template adds between the conversation up to it (with the
    generation prompt) and the conversation including it, so template markers such as the end-of-turn
    token are scored with the answer. Templates must render a conversation as an extension of its
    prefixes, which every common template does.
    """
    messages = chat.as_dicts()

    def render(n: int, generation_prompt: bool) -> str:
        if n == 0:
            return ""
        return tokenizer.apply_chat_template(messages[:n], tokenize=False, add_generation_prompt=generation_prompt)

    segments: list[Segment] = []
    done = ""
    for i, (role, _) in enumerate(chat.messages):
        if role != "assistant":
            continue
        prompt, full = render(i, True), render(i + 1, False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise InputDataError(
                f"chat template of {tokenizer.name_or_path or 'the tokenizer'} does not render message {i} as an "
                "extension of the conversation before it; use chat_template=default"
            )
        segments += [Segment(prompt[len(done) :], False), Segment(full[len(prompt) :], True)]
        done = full
    rest = render(len(messages), False)[len(done) :]
    if rest:
        segments.append(Segment(rest, False))
    return [s for s in segments if s.text]


def render_segments(example: Example, tokenizer: PreTrainedTokenizerBase, chat_template: str = "auto") -> list[Segment]:
    """The scored/unscored text segments of one example (see the module docstring)."""
    if isinstance(example, QAPair):
        return [Segment(example.prompt_text(), False), Segment(example.response_text(tokenizer.eos_token), True)]
    if chat_template == "auto" and tokenizer.chat_template:
        return template_chat_segments(example, tokenizer)
    return default_chat_segments(example, tokenizer.eos_token)


def encode_example(
    tokenizer: PreTrainedTokenizerBase, example: Example, max_len: int, *, chat_template: str = "auto"
) -> Encoded:
    """``(input_ids, labels)`` of one example truncated to ``max_len``; unscored labels are ``IGNORE_INDEX``.

    Special tokens (a BOS) are added before the first segment only, and not at all for chat templates,
    which write their own.
    """
    ids, labels = _encode_many(tokenizer, [example], chat_template)[0]
    return ids[:max_len], labels[:max_len]


def _encode_many(tokenizer: PreTrainedTokenizerBase, examples: list[Example], chat_template: str) -> list[Encoded]:
    """Untruncated ``(input_ids, labels)`` of each example, with one tokenizer call per special-token setting."""
    segments: list[tuple[int, Segment, bool]] = []  # (example, segment, special tokens before it)
    for i, example in enumerate(examples):
        use_template = isinstance(example, Chat) and chat_template == "auto" and bool(tokenizer.chat_template)
        for j, segment in enumerate(render_segments(example, tokenizer, chat_template)):
            segments.append((i, segment, j == 0 and not use_template))
    pieces: list[list[int]] = [[] for _ in segments]
    for special in (True, False):
        positions = [k for k, (_, _, with_special) in enumerate(segments) if with_special == special]
        if positions:
            texts = [segments[k][1].text for k in positions]
            for k, piece in zip(positions, tokenizer(texts, add_special_tokens=special)["input_ids"], strict=True):
                pieces[k] = piece
    encoded: list[Encoded] = [([], []) for _ in examples]
    for (i, segment, _), piece in zip(segments, pieces, strict=True):
        encoded[i][0].extend(piece)
        encoded[i][1].extend(piece if segment.scored else [IGNORE_INDEX] * len(piece))
    return encoded


def final_answer(example: Example) -> str | None:
    """The answer a long example can be split along: a pair's response or a chat's closing assistant message."""
    if isinstance(example, QAPair):
        return example.response
    role, content = example.messages[-1]
    return content if role == "assistant" else None


def with_final_answer(example: Example, answer: str) -> Example:
    """``example`` with its final answer (see :func:`final_answer`) replaced by ``answer``."""
    if isinstance(example, QAPair):
        return replace(example, response=answer)
    return Chat((*example.messages[:-1], ("assistant", answer)))


def split_long_example(
    tokenizer: PreTrainedTokenizerBase, example: Example, max_len: int, *, chat_template: str = "auto", lang: ChunkLang
) -> list[Encoded]:
    """One encoded example, or, when it is longer than ``max_len``, one per run of whole sentences of its answer.

    Each part keeps everything before the final answer and holds as many sentences as fit in ``max_len``
    (a sentence too long alone is cut at token boundaries). An example without a final answer, or whose
    prompt leaves fewer than ``MIN_CHUNK_TOKENS`` tokens for it, is truncated instead.
    """
    answer = final_answer(example)
    if answer is None:
        return [encode_example(tokenizer, example, max_len, chat_template=chat_template)]
    (ids, labels), (frame, _) = _encode_many(tokenizer, [example, with_final_answer(example, "")], chat_template)
    if len(ids) <= max_len:
        return [(ids, labels)]
    # What the answer's tokens may use: max_len less everything around an empty answer (template, EOS).
    budget = max_len - len(frame)
    while budget >= MIN_CHUNK_TOKENS:
        chunks = SentenceChunker(tokenizer, budget, lang).chunk(answer)
        parts = _encode_many(tokenizer, [with_final_answer(example, c.text) for c in chunks], chat_template)
        # An answer's tokens in context may outnumber its own (a merge across the boundary): shrink and retry.
        excess = max(len(part_ids) for part_ids, _ in parts) - max_len
        if excess <= 0:
            return parts
        budget -= excess
    return [(ids[:max_len], labels[:max_len])]


def encode_examples(
    tokenizer: PreTrainedTokenizerBase,
    examples: list[Example],
    max_len: int,
    *,
    chat_template: str = "auto",
    split_lang: ChunkLang | None = None,
) -> tuple[list[Encoded], int]:
    """Encode ``examples`` into rows of at most ``max_len`` tokens; returns the rows and how many examples were split.

    With ``split_lang`` (``en``, ``zh`` or ``auto``: the sentence rules) an example longer than ``max_len``
    is split by :func:`split_long_example`; without it, truncated.
    """
    rows: list[Encoded] = []
    split = 0
    for example, (ids, labels) in zip(examples, _encode_many(tokenizer, examples, chat_template), strict=True):
        if split_lang is None or len(ids) <= max_len:
            rows.append((ids[:max_len], labels[:max_len]))
            continue
        parts = split_long_example(tokenizer, example, max_len, chat_template=chat_template, lang=split_lang)
        rows += parts
        split += len(parts) > 1
    return rows, split
