"""An OpenAI request, tokenized, validated once into the engine's typed requests.

``completion_requests`` and ``chat_requests`` are the server's front door (and any other
server's: a handler that has parsed and tokenized a body calls one of them, then hands the
``EngineRequest``s to ``AsyncEngine.submit``, which checks nothing again). The checks are the
engine's own (``runtime/input_processor.py``), in the order a client can act on: the prompt
(answered for the field it came in: ``prompt`` or ``messages``), then ``max_tokens`` against the
room the prompt leaves, then the sampling parameters, then whether each prompt fits the pages
with them. A grammar's compile (a bad schema is a 400 too) is the handler's next, awaited step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from oscar_compile.runtime.core.sampling_params import RequestError, SamplingParams, StructuredOutputParams
from oscar_compile.runtime.input_processor import EngineRequest, InputProcessor
from oscar_compile.runtime.server.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
)
from oscar_compile.runtime.server.tool_calls import with_tool_constraint


@dataclass(frozen=True)
class MaxTokens:
    """What a request asked of ``max_tokens``: ``requested`` under the name ``field`` (None: not
    given, then ``default``), for ``n`` choices; 0 is allowed only when ``scoring`` the prompt."""

    field: str
    requested: int | None
    default: int
    scoring: bool = False
    n: int = 1


def completion_requests(processor: InputProcessor, req: CompletionRequest, prompts: list[list[int]],
                        request_id: str, arrival: float) -> list[EngineRequest]:
    """One request per prompt of a ``/v1/completions`` body (``prompts``: its prompts tokenized)."""
    max_tokens = MaxTokens("max_tokens", req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS,
                           scoring=req.num_prompt_logprobs() is not None, n=req.n)
    return openai_requests(processor, prompts, "prompt", lambda n: req.sampling_params(n, req.logprobs), max_tokens,
                           request_id, arrival)


def chat_requests(processor: InputProcessor, req: ChatCompletionRequest, prompt: list[int],
                  constraint: StructuredOutputParams | None, default_max_tokens: int, request_id: str,
                  arrival: float) -> list[EngineRequest]:
    """The request of a ``/v1/chat/completions`` body (``prompt``: its messages rendered and
    tokenized; ``constraint``: a forced tool call's, or None)."""
    field, requested = req.requested_max_tokens()
    max_tokens = MaxTokens(field, requested, default_max_tokens, scoring=req.prompt_logprobs is not None, n=req.n)
    return openai_requests(
        processor, [prompt], "messages",
        lambda n: with_tool_constraint(req.sampling_params(n, req.num_logprobs()), constraint), max_tokens,
        request_id, arrival)


def openai_requests(processor: InputProcessor, prompts: list[list[int]], prompt_param: str,
                    make_params: Callable[[int], SamplingParams], max_tokens: MaxTokens, request_id: str,
                    arrival: float) -> list[EngineRequest]:
    """Prompt ``i`` becomes request ``{request_id}-{i}``, all with the params ``make_params``
    builds for the resolved ``max_tokens``; RequestError (a 400) at the first check that fails."""
    for ids in prompts:
        processor.check_prompt(ids, prompt_param)
    params = make_params(resolve_max_tokens(processor, max_tokens, prompts))
    processor.check_params(params)
    return [processor.make_request(ids, params, f"{request_id}-{i}", arrival) for i, ids in enumerate(prompts)]


def resolve_max_tokens(processor: InputProcessor, asked: MaxTokens, prompts: list[list[int]]) -> int:
    """``asked.requested`` if every prompt leaves room for it in each of its ``n`` choices (the
    pages of all of them counted), else a 400 naming the field (as OpenAI and vLLM refuse it,
    rather than cutting the output short); without one, the default capped by that room."""
    room, longest = min((processor.max_new_tokens(len(ids), asked.n), len(ids)) for ids in prompts)
    field, requested = asked.field, asked.requested
    if requested is None:
        return max(min(asked.default, room), 1)
    if requested < (0 if asked.scoring else 1):
        why = " (0 only with echo or prompt_logprobs: scoring the prompt)" if requested == 0 else ""
        raise RequestError(field, f"{field} must be >= {0 if asked.scoring else 1}, got {requested}{why}")
    if requested > room:
        context = processor.max_model_len
        if longest + room >= context:
            what = f"This model's maximum context length is {context} tokens"
        else:
            each = f" in each of {asked.n} choices" if asked.n > 1 else ""
            what = f"The KV cache holds at most {longest + room} tokens{each} for one request"
        raise RequestError(field, f"{what}. However, you requested {longest + requested} tokens "
                           f"({longest} in the prompt, {requested} in the completion). "
                           f"Please reduce the prompt or {field}.", code="context_length_exceeded")
    return requested
