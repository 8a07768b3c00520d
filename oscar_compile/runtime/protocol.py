"""OpenAI request bodies, validated strictly, and their translation to SamplingParams.

Like the OpenAI API, an unknown field is an error (a typo such as ``max_token`` must not be
silently ignored) and wrong JSON types are not coerced (``"max_tokens": "5"`` is a 400).
Fields OpenAI defines but this server does not implement are accepted only at their neutral
value (``n: 1``, penalties 0, no ``logit_bias``...) and refused otherwise, naming the field.
A few vLLM-style extensions are accepted: ``top_k``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from oscar_compile.runtime.sampling_params import MAX_LOGPROBS, RequestError, SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the legacy completions API default


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    # accepted and ignored: they do not change what is generated
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    # extensions
    top_k: Optional[int] = None
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True

    def check_unsupported(self) -> None:
        if self.n != 1:
            raise RequestError("n", "only n = 1 is supported")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise RequestError(name, f"{name} is not supported (must be 0)")
        if self.logit_bias:
            raise RequestError("logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options", "stream_options is only allowed with stream: true")

    def sampling_params(self, max_tokens: int, logprobs: Optional[int]) -> SamplingParams:
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
        )


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise RequestError("echo", "echo is not supported")
        if self.best_of not in (None, 1):
            raise RequestError("best_of", "best_of is not supported")
        if self.suffix:
            raise RequestError("suffix", "suffix is not supported")

    def prompts(self) -> list[Union[str, list[int]]]:
        """One entry per prompt: a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise RequestError("prompt", "prompt must not be empty")
        if isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[dict[str, Any]] = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.tools:
            raise RequestError("tools", "tool calling is not supported")
        if self.tool_choice not in (None, "none"):
            raise RequestError("tool_choice", "tool calling is not supported")
        if self.response_format not in (None, {"type": "text"}):
            raise RequestError("response_format", "only response_format {type: text} is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs", "top_logprobs needs logprobs: true")

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None
