"""Per-request sampling settings, validated up front so a bad value fails at submission.

Kept free of torch so the bookkeeping classes (Sequence, Scheduler) can import it cheaply.
Every check raises ValueError naming the field: the server turns it into a 400 with ``param``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_N = 16  # choices per request (parallel sampling): each one holds its own window pages
MAX_PENALTY = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty
MAX_LOGIT_BIAS = 100.0  # OpenAI: a bias is in [-100, 100]
# Below this temperature sampling is greedy: dividing logits by ~0 only overflows.
GREEDY_TEMPERATURE = 1e-5


class RequestError(ValueError):
    """A ValueError that remembers which field was wrong (``param``) and why (``code``), so the
    server can answer with an OpenAI-style error body."""

    def __init__(self, param: str | None, message: str, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class StructuredOutputParams:
    """What the output must match: exactly one of a JSON schema, any JSON object, a regex, a
    choice among strings, or a grammar (vLLM's ``structured_outputs`` fields; the server maps
    OpenAI's ``response_format`` and a forced tool call onto them).

    Kept as plain data so core stays free of the grammar engines: a backend in
    ``runtime/structured_output/`` compiles it, and ``key`` is what its compile cache is keyed on.
    ``param`` prefixes every error so the server can name the field the client sent;
    ``value_param``, when the constraint's value sits elsewhere than ``{param}.{kind}`` (OpenAI's
    ``response_format.json_schema.schema``), is the field a compile error of that value names.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    param: str = "structured_outputs"
    value_param: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise RequestError(
                self.param,
                f"structured output needs exactly one of json, json_object, regex, choice, grammar; got {given}",
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            message = f"json must be a JSON schema object or its text, got {self.json!r}"
            raise RequestError(f"{self.param}.json", message)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError(f"{self.param}.{name}", f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise RequestError(f"{self.param}.choice", f"choice must be a non-empty list, got {self.choice!r}")
            if not all(isinstance(c, str) for c in self.choice):
                raise RequestError(f"{self.param}.choice", "choice must hold strings")
            object.__setattr__(self, "choice", list(self.choice))

    @property
    def kind(self) -> str:
        return (
            "json_object"
            if self.json_object
            else next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)
        )

    @property
    def key(self) -> str:
        """A canonical text of the constraint: equal schemas written in another key order share it."""
        value = getattr(self, self.kind) if self.kind != "json_object" else True
        if self.kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                pass  # the backend reports the bad schema with its own message
        return f"{self.kind}:{json.dumps(value, sort_keys=True, separators=(',', ':'))}"


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. top_k <= 0 and top_p 1 switch those filters off. ``seed`` (any
    int in [-2^63, 2^64), taken mod 2^64) fixes the request's draws: the token at position ``p``
    is drawn with noise keyed on (seed, p) only (worker/sampler.py), so the output does not depend
    on what else is batched or on preemption. Without one the engine assigns ``default_seed``.
    ``logprobs``: None for none, k >= 0 to return the chosen token's logprob plus the k best.
    ``stop`` strings are not part of the returned text; EOS ends the request unless ``ignore_eos``.

    The logit controls follow vLLM (applied on the device, worker/logits_controls.py):
    ``repetition_penalty`` (> 0, 1 = off) divides the positive logits and multiplies the negative
    ones of every token seen in the prompt or the output; ``presence_penalty`` and
    ``frequency_penalty`` (OpenAI's, in [-2, 2]) subtract ``presence * (count > 0) + frequency *
    count`` over the output tokens only; ``logit_bias`` adds a bias in [-100, 100] to a token id's
    logit; ``min_tokens`` masks EOS (unless ``ignore_eos``) and ``stop_token_ids`` until that many
    tokens were generated; ``min_p`` in [0, 1] drops tokens whose probability (after temperature)
    is below ``min_p`` times the top token's. Logprobs stay the model's own, before all of them.

    ``prompt_logprobs``: None for none, k >= 0 for every prompt token's logprob (teacher-forced, from
    the prefill) plus the k best at each position (vLLM's extra; the server's ``echo`` uses it too).
    Such a request is prefilled from position 0, with no prefix-cache hit. Only it may ask
    ``max_tokens`` 0: score the prompt, generate nothing.

    ``structured_output``: the constraint the output must match (``StructuredOutputParams``).

    ``n`` (1 to ``MAX_N``): choices drawn for the prompt, as vLLM's ``n``. The prompt is prefilled
    once, then forked (page_manager, "Parallel sampling"); choice ``i`` draws with ``seed + i``.
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
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    structured_output: StructuredOutputParams | None = None
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        _check_int("max_tokens", self.max_tokens, low=0 if self.prompt_logprobs is not None else 1)
        _check_int("n", self.n, low=1, high=MAX_N)
        if self.n > 1 and self.structured_output is not None:
            # a forked choice would need its own copy of the grammar state (not built yet)
            raise RequestError("n", "n > 1 is not supported with a structured-output constraint "
                                    "(response_format, structured_outputs or a forced tool_choice)")
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
        self._check_controls()

    def _check_controls(self) -> None:
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise RequestError("repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), low=-MAX_PENALTY, high=MAX_PENALTY)
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        _check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise RequestError("logit_bias", f"logit_bias must map token ids to biases, got {self.logit_bias!r}")
        for token, bias in (self.logit_bias or {}).items():
            _check_int("logit_bias", token, low=0)
            _check_number("logit_bias", bias, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS)
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def has_logit_controls(self) -> bool:
        """Whether the sampler must change this request's logits before sampling (min_p, a
        filter like top_p, is not one of them)."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0


def default_seed(base_seed: int, request_id: str) -> int:
    """The seed of a request that gives none: a stable 64-bit hash of the engine's base seed
    (``EngineConfig.seed``, 0 by default as vLLM's ``--seed``) and the request id.

    Two requests with different ids get unrelated draws (sampling without a seed stays random
    across requests), yet each is reproducible: rerun it with ``seed`` = its ``Sequence.seed``
    (the engine logs it at debug level), or resend it under the same id to an engine with the
    same base seed. ``LLM.generate`` names requests by arrival (``Sequence.seq_id``), so one
    script's outputs repeat run to run. SGLang's deterministic mode instead gives every unseeded
    request one fixed seed (42): the same prompt then always gives the same text."""
    digest = hashlib.blake2b(f"{base_seed & 0xFFFF_FFFF_FFFF_FFFF}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


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
