"""How a chat request's ``tool_choice`` shapes its prompt, its decoding and its response.

- ``"none"`` (or no tools): a plain chat; the tools are still rendered into the prompt, as vLLM
  renders them.
- ``"auto"``: the model decides; the output is read back by the ``--tool-call-parser``. As in vLLM,
  it needs ``--enable-auto-tool-choice`` (a 400 naming ``tool_choice`` otherwise), and since a
  request with ``tools`` and no ``tool_choice`` means ``"auto"``, so does such a request.
- ``"required"`` and a named function: grammar-constrained (tool_choice.py).

The response: ``tool_calls`` (``[{id, type: "function", function: {name, arguments}}]``, arguments a
JSON string), ``content`` null when the output holds only calls, and ``finish_reason:
"tool_calls"`` when the calls are whole (the output stopped by itself; cut short by ``max_tokens``
it stays ``"length"``), but ``"stop"`` for a named function, as OpenAI and vLLM answer.
``parallel_tool_calls: false`` keeps the first call only (and a required output's schema allows
one).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from oscar_compile.runtime.core.sampling_params import RequestError, SamplingParams, StructuredOutputParams
from oscar_compile.runtime.server.tool_choice import (
    NamedCall,
    RequiredCalls,
    constrained_output,
    function_schema,
    required_schema,
)
from oscar_compile.runtime.server.tool_parsers.base import ToolCallStream, ToolParser
from oscar_compile.runtime.server.tool_protocol import ToolFields

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


class ToolCallPlan:
    """Turns one request's outputs into tool calls, whole (``message``) and streamed (``stream``)."""

    def __init__(
        self,
        reader: ToolParser | NamedCall | RequiredCalls,
        max_calls: int | None,
        calls_finish_reason: str = "tool_calls",
    ):
        self.reader = reader
        self.max_calls = max_calls
        self.calls_finish_reason = calls_finish_reason  # of an output that stopped by itself with calls

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the choice's ``message``, its ``finish_reason``) for the whole output ``text``."""
        extracted = self.reader.extract(text)
        calls = extracted.calls[: self.max_calls]
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        message = {"role": "assistant", "content": extracted.content, "tool_calls": [c.as_openai() for c in calls]}
        return message, self.finish_reason(finish_reason, called=True)

    def stream(self) -> ChoiceToolStream:
        return ChoiceToolStream(self.reader.stream(), self.max_calls)

    def finish_reason(self, finish_reason: str | None, called: bool) -> str | None:
        return self.calls_finish_reason if called and finish_reason == "stop" else finish_reason


class ChoiceToolStream:
    """One streamed choice's tool-call state, calls past ``max_calls`` left out."""

    def __init__(self, inner: ToolCallStream, max_calls: int | None):
        self.inner = inner
        self.max_calls = max_calls

    @property
    def called(self) -> bool:
        return self.inner.num_calls > 0

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        delta = self.inner.feed(text, final)
        if self.max_calls is not None and "tool_calls" in delta:
            kept = [entry for entry in delta["tool_calls"] if entry["index"] < self.max_calls]
            delta = {k: v for k, v in delta.items() if k != "tool_calls"} | ({"tool_calls": kept} if kept else {})
        return delta


def plan_tool_calls(
    req: ToolFields, parser: ToolParser | None, auto_enabled: bool
) -> tuple[ToolCallPlan | None, StructuredOutputParams | None]:
    """(how to read the output, the constraint on it) for ``req``; (None, None) for a plain chat."""
    choice = req.effective_tool_choice()
    max_calls = 1 if req.parallel_tool_calls is False else None
    if choice == "none":
        return None, None
    if choice == "auto":
        if parser is None or not auto_enabled:
            raise RequestError("tool_choice", AUTO_NEEDS_FLAGS)
        return ToolCallPlan(parser, max_calls), None
    if choice == "required":
        return ToolCallPlan(RequiredCalls(), max_calls), constrained_output(
            required_schema(req.tools, req.parallel_tool_calls)
        )
    tool = next(t for t in req.tools if t.function.name == choice.function.name)  # check_tools made sure
    plan = ToolCallPlan(NamedCall(tool.function.name), 1, calls_finish_reason="stop")
    return plan, constrained_output(function_schema(tool))


def with_tool_constraint(params: SamplingParams, constraint: StructuredOutputParams | None) -> SamplingParams:
    """``params`` constrained by a forced tool choice; a request that already constrains its output
    (``response_format``, ``structured_outputs``) cannot force one too (vLLM refuses it as well)."""
    if constraint is None:
        return params
    if params.structured_output is not None:
        raise RequestError(
            "tool_choice",
            "a required or named tool_choice cannot be combined with "
            "response_format or structured_outputs: both constrain the output",
        )
    return dataclasses.replace(params, structured_output=constraint)
