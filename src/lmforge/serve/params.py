"""Validate what a request asks for (prompt, max_tokens, sampling), with one message per problem.

The same rules hold on every route (v1, v2 and OpenAI completions); a violation raises :class:`RequestError`,
which each route answers with HTTP 400 and the message.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmforge.errors import LmforgeError

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "seed")
# The domains the decoder accepts. A seed seeds numpy's ``default_rng`` (``SeedSequence``: non-negative integers;
# bounded to 64 bits, what OpenAI's int64 seed and orjson carry). The sampler divides float32 logits by the
# temperature in float64: below MIN_TEMPERATURE the quotient can overflow to inf and the probabilities to NaN, and
# the distribution is greedy to within rounding anyway, so such a temperature is refused (0 asks for greedy).
MAX_SEED = 2**64 - 1
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 2.0
# A prompt longer than this many characters per context token cannot fit (no BPE token is that long), so it is
# refused before it is tokenized on the event loop.
MAX_CHARS_PER_TOKEN = 64


class RequestError(LmforgeError):
    """A request the predictor refuses (HTTP 400); the message names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Limits:
    """What the served model and the configuration allow."""

    context: int
    max_tokens_limit: int
    default_max_tokens: int
    default_temperature: float
    max_prompts: int


@dataclass(frozen=True)
class Sampling:
    """Validated decoding settings of one request."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None


def _number(value: Any) -> bool:
    """A JSON number that is finite (not a bool, NaN or an infinity)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_sampling(raw: Mapping[str, Any], limits: Limits, *, where: str = "") -> Sampling:
    """Sampling settings from ``raw`` (missing keys take the defaults); raise :class:`RequestError` if invalid.

    Every value is checked against the domain the decoder accepts, so a request that passes cannot fail decoding.
    """
    at = f"{where}." if where else ""
    max_tokens = raw.get("max_tokens", limits.default_max_tokens)
    if max_tokens is None:
        max_tokens = limits.default_max_tokens
    if not _integer(max_tokens) or max_tokens < 1:
        raise RequestError(f"{at}max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
    if max_tokens > limits.max_tokens_limit:
        raise RequestError(
            f"{at}max_tokens {max_tokens} exceeds this server's limit of {limits.max_tokens_limit}", "max_tokens"
        )
    temperature = raw.get("temperature", limits.default_temperature)
    if temperature is None:
        temperature = limits.default_temperature
    if not _number(temperature) or not (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
        raise RequestError(
            f"{at}temperature must be 0 (greedy) or a number in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
            f"got {temperature!r}",
            "temperature",
        )
    top_p = raw.get("top_p", 1.0)
    if top_p is None:
        top_p = 1.0
    if not _number(top_p) or not 0.0 < top_p <= 1.0:
        raise RequestError(f"{at}top_p must be a number in (0, 1], got {top_p!r}", "top_p")
    seed = raw.get("seed")
    if seed is not None and (not _integer(seed) or not 0 <= seed <= MAX_SEED):
        raise RequestError(f"{at}seed must be an integer in [0, 2**64 - 1], got {seed!r}", "seed")
    return Sampling(max_tokens, float(temperature), float(top_p), seed)


def check_prompt_count(count: int, limits: Limits, where: str = "prompt") -> None:
    """Refuse a request with no prompt or more than ``limits.max_prompts``, before any per-prompt work."""
    if count < 1:
        raise RequestError(f"{where} holds no prompt", "prompt")
    if count > limits.max_prompts:
        raise RequestError(
            f"{where} holds {count} prompts; this server takes at most {limits.max_prompts} per request "
            "(serve.max_prompts_per_request): split it into several requests",
            "prompt",
        )


def check_prompt(prompt: Any, limits: Limits, where: str = "prompt") -> str:
    """``prompt`` if it is a non-empty string of plausible length; else raise :class:`RequestError`."""
    if not isinstance(prompt, str):
        raise RequestError(f"{where} must be a string, got {type(prompt).__name__}", "prompt")
    if not prompt:
        raise RequestError(f"{where} is empty", "prompt")
    if len(prompt) > MAX_CHARS_PER_TOKEN * limits.context:
        raise RequestError(
            f"{where} has {len(prompt)} characters, far more than the model's context of {limits.context} tokens",
            "prompt",
        )
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(
            f"{where} is not valid Unicode text: {exc.reason} at character {exc.start}", "prompt"
        ) from exc
    return prompt


def check_length(n_prompt: int, sampling: Sampling, limits: Limits, where: str = "prompt") -> None:
    """Refuse a prompt that tokenizes to nothing, or that leaves no room for ``max_tokens`` in the context."""
    if n_prompt == 0:
        raise RequestError(f"{where} tokenizes to no tokens", "prompt")
    if n_prompt + sampling.max_tokens > limits.context:
        raise RequestError(
            f"{where} has {n_prompt} tokens; with max_tokens {sampling.max_tokens} that exceeds the model's "
            f"context of {limits.context} tokens",
            "max_tokens" if n_prompt < limits.context else "prompt",
        )
