"""Per-request sampling settings, validated up front so a bad value fails at submission.

Kept free of torch so the bookkeeping classes (Sequence, Scheduler) can import it cheaply.
Every check raises ValueError naming the field: the server turns it into a 400 with ``param``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
# Below this temperature sampling is greedy: dividing logits by ~0 only overflows.
GREEDY_TEMPERATURE = 1e-5


class RequestError(ValueError):
    """A ValueError that remembers which field was wrong (``param``) and why (``code``), so the
    server can answer with an OpenAI-style error body."""

    def __init__(self, param: str | None, message: str, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. top_k <= 0 and top_p 1 switch those filters off. ``seed`` gives
    the request its own random stream, so its output does not depend on what else is batched.
    ``logprobs``: None for none, k >= 0 to return the chosen token's logprob plus the k best.
    ``stop`` strings are not part of the returned text; EOS ends the request unless ``ignore_eos``.
    ``prompt_logprobs``: None for none, k >= 0 for every prompt token's logprob (teacher-forced, from
    the prefill) plus the k best at each position (vLLM's extra; the server's ``echo`` uses it too).
    Such a request is prefilled from position 0, with no prefix-cache hit. Only it may ask
    ``max_tokens`` 0: score the prompt, generate nothing.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        _check_int("max_tokens", self.max_tokens, low=0 if self.prompt_logprobs is not None else 1)
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p == 0.0:
            raise RequestError("top_p", "top_p must be in (0, 1], got 0")
        _check_int("top_k", self.top_k, low=-1)
        if self.seed is not None:
            _check_int("seed", self.seed, low=-(2**63), high=2**64 - 1)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise RequestError("stop", f"stop must hold non-empty strings, got {text!r}")
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token, low=0)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(name, f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _check_int(name: str, value, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(name, f"{name} must be an integer, got {value!r}")
    _check_range(name, value, low, high)


def _check_number(name: str, value, low: float | None = None, high: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(name, f"{name} must be a finite number, got {value!r}")
    _check_range(name, value, low, high)


def _check_range(name: str, value, low, high) -> None:
    if low is not None and value < low:
        raise RequestError(name, f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise RequestError(name, f"{name} must be <= {high}, got {value}")
