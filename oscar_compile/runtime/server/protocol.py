"""OpenAI request bodies, validated strictly, and their translation to SamplingParams.

Wrong JSON types are not coerced (``"max_tokens": "5"`` is a 400). An unknown field is accepted
and ignored, as vLLM does (lm-eval spreads a task's generation kwargs into the body): the server
names it in a warning and counts it in ``/metrics``, and ``--strict-fields`` makes it a 400 again
(``unknown_fields`` lists them, with their paths). An explicit ``null`` for any optional field
means its default, as OpenAI accepts ``null`` for its nullable fields (``n``, ``stream``,
penalties...).
Fields OpenAI defines but this server does not implement are accepted only at their neutral
value and refused otherwise, naming the field. ``n`` (1 to 16) returns that many choices per
prompt (the prompt is prefilled once; choice ``i`` draws with ``seed + i``); ``best_of``, which
vLLM removed, is accepted only as ``null`` or equal to ``n``. The sampling controls follow vLLM:
``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` (OpenAI's), and the vLLM-style
extensions ``repetition_penalty``, ``min_p``, ``min_tokens``, ``top_k``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens``, ``prompt_logprobs``; ``null`` means the default for each of them.

Prompt scoring, as vLLM does it: completions' ``echo`` returns the prompt before the completion,
and with ``logprobs`` the prompt tokens' entries first (the first token's ``null``);
``prompt_logprobs: k`` (both routes) returns vLLM's ``prompt_logprobs`` list. Either makes
``max_tokens: 0`` valid (the prompt alone). A completions stream carries them in each choice's
first chunk; a chat stream does not take ``prompt_logprobs`` (a 400).

Bounds follow OpenAI's API reference where it states one (penalties in [-2, 2], ``logit_bias``
values in [-100, 100] on token ids of the vocabulary, ``metadata`` of 16 pairs, content required on
every message without tool calls, a ``tool_call_id`` on tool messages) and vLLM's protocol models
otherwise (up to 20 logprobs, ``repetition_penalty`` > 0, ``min_p`` in [0, 1], ``min_tokens`` <=
``max_tokens``). Where
neither states a bound, one is set here so a single request cannot make the server do unbounded
work per token: ``MAX_STOP_SEQUENCES`` stop strings (OpenAI caps them at 4, vLLM not at all; lm-eval's
code tasks send 6) of at most ``MAX_STOP_CHARS`` characters each, ``MAX_STOP_TOKEN_IDS``
stop token ids, ``MAX_PROMPTS`` prompts in one completions request. ``check`` runs the checks
pydantic's field types cannot express; ``max_tokens`` against the context is the server's check
(it needs the prompt's length).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from oscar_compile.runtime.core.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PENALTY,
    RequestError,
    SamplingParams,
    StructuredOutputParams,
)
from oscar_compile.runtime.server.strict_model import StrictModel as _Strict
from oscar_compile.runtime.server.structured_outputs import structured_output_params
from oscar_compile.runtime.server.tool_protocol import AssistantToolCall, ToolFields

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the legacy completions API default
MAX_STOP_SEQUENCES = 64  # OpenAI: "up to 4 sequences"; vLLM: unbounded
MAX_STOP_CHARS = 1024  # a stream holds back this many characters minus one
MAX_STOP_TOKEN_IDS = 256
MAX_PROMPTS = 128
_METADATA_PAIRS, _METADATA_KEY_CHARS, _METADATA_VALUE_CHARS = 16, 64, 512


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """The dotted paths of the fields in ``model`` (nested models and lists of them included)
    that no schema names, e.g. ``["do_sample", "messages.0.weight"]``."""
    found = [prefix + name for name in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            if isinstance(item, BaseModel):
                path = f"{prefix}{name}." if index is None else f"{prefix}{name}.{index}."
                found += unknown_fields(item, path)
    return found


class StreamOptions(_Strict):
    include_usage: bool = False


class StructuredOutputsRequest(_Strict):
    """vLLM's ``structured_outputs`` (mapped in structured_outputs.py); ``json`` is ``json_``
    here, pydantic models own a ``json`` attribute."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # JSON keys: token ids as strings
    # accepted and ignored: they do not change what is generated
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # extensions
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # structured output (server/structured_outputs.py): OpenAI's and vLLM's, on both routes
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    def check(self) -> None:
        """Refuse what the field types allow but OpenAI / vLLM refuse, or this server lacks."""
        if not 1 <= self.n <= MAX_N:
            raise RequestError("n", f"n must be between 1 and {MAX_N}, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise RequestError(name, f"{name} must be in [-2, 2], got {value}")
        self._check_stops()
        self._check_metadata()
        self.token_logit_bias()
        self.structured_output()
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options", "stream_options is only allowed with stream: true")

    def _check_stops(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise RequestError("stop", f"stop takes at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}")
        for text in stops:
            if not text:
                raise RequestError("stop", "stop sequences must not be empty")
            if len(text) > MAX_STOP_CHARS:
                raise RequestError("stop", f"stop sequences are at most {MAX_STOP_CHARS} characters, "
                                   f"got one of {len(text)}")
        if len(self.stop_token_ids or []) > MAX_STOP_TOKEN_IDS:
            raise RequestError("stop_token_ids", f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, "
                               f"got {len(self.stop_token_ids)}")

    def _check_metadata(self) -> None:
        metadata = self.metadata or {}
        if len(metadata) > _METADATA_PAIRS:
            raise RequestError("metadata", f"metadata holds at most {_METADATA_PAIRS} pairs, got {len(metadata)}")
        for key, value in metadata.items():
            if len(key) > _METADATA_KEY_CHARS or len(value) > _METADATA_VALUE_CHARS:
                raise RequestError("metadata", f"metadata keys are at most {_METADATA_KEY_CHARS} characters "
                                   f"and values at most {_METADATA_VALUE_CHARS}")

    def token_logit_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with integer keys; a key that is not a token id or a bias outside
        [-100, 100] is a 400 naming ``logit_bias`` (the vocabulary is the server's check)."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.isdigit():
                raise RequestError("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise RequestError("logit_bias", f"logit_bias values must be in [-100, 100], got {value}")
            bias[int(key)] = value
        return bias

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k if self.top_k is not None else 0,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=self.token_logit_bias(),
            min_p=self.min_p or 0.0,
            min_tokens=self.min_tokens or 0,
            prompt_logprobs=self.num_prompt_logprobs(),
            n=self.n,
            structured_output=self.structured_output(),
        )

    def structured_output(self) -> StructuredOutputParams | None:
        return structured_output_params(self.structured_outputs, self.response_format)

    def num_prompt_logprobs(self) -> int | None:
        """The k best to return at each prompt position (None: the prompt is not scored)."""
        return self.prompt_logprobs


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if self.best_of not in (None, self.n):
            raise RequestError("best_of", f"best_of must be null or equal to n ({self.n}), got {self.best_of}: "
                               "choosing the best of more samples than returned is not supported (vLLM removed it)")
        if self.suffix:
            raise RequestError("suffix", "suffix is not supported")

    def num_prompt_logprobs(self) -> int | None:
        """``echo`` with ``logprobs`` scores the prompt too; so does ``echo`` with ``max_tokens`` 0."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        if self.echo and self.max_tokens == 0:
            wanted.append(0)
        return max(wanted) if wanted else None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise RequestError("prompt", "prompt must not be empty")
        if isinstance(prompt[0], int):
            return [prompt]
        if len(prompt) > MAX_PROMPTS:
            raise RequestError("prompt", f"one request takes at most {MAX_PROMPTS} prompts, got {len(prompt)}")
        return list(prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[AssistantToolCall] | None = None

    def check(self, index: int) -> None:
        """OpenAI: content is required unless an assistant message makes tool calls, a content
        array holds at least one part, only assistant messages make tool calls, and only a tool
        message, which must have one, answers a ``tool_call_id``."""
        where = f"messages.{index}"
        if self.tool_calls is not None and self.role != "assistant":
            raise RequestError(f"{where}.tool_calls", f"{where}: only assistant messages take tool_calls")
        if self.content is None and not self.tool_calls:
            raise RequestError(f"{where}.content", f"{where}: a {self.role} message needs content")
        if isinstance(self.content, list) and not self.content:
            raise RequestError(f"{where}.content", f"{where}: content must hold at least one part")
        if self.role == "tool" and not self.tool_call_id:
            raise RequestError(f"{where}.tool_call_id", f"{where}: a tool message needs tool_call_id")
        if self.role != "tool" and self.tool_call_id is not None:
            raise RequestError(f"{where}.tool_call_id", f"{where}: only tool messages take tool_call_id")

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.as_template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_Common, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the chat template

    def check(self) -> None:
        super().check()
        check_chat_template_kwargs(self.chat_template_kwargs)
        for index, message in enumerate(self.messages):
            message.check(index)
        self.check_tools()
        if self.stream and self.prompt_logprobs is not None:
            raise RequestError("prompt_logprobs", "prompt_logprobs is not supported with stream: true on chat")
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs", "top_logprobs needs logprobs: true")

    def requested_max_tokens(self) -> tuple[str, int | None]:
        """(the field that set it, its value): ``max_completion_tokens`` wins, as in OpenAI's API."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# apply_chat_template's own arguments: the server sets them, a request's template variables may not
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_chat_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """Variables for the chat template (``enable_thinking``...), refused when they would set one of
    ``apply_chat_template``'s own arguments."""
    for key in kwargs or {}:
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise RequestError(f"chat_template_kwargs.{key}",
                               f"chat_template_kwargs.{key}: set by the server, not a template variable")
