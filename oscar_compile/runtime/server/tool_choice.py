"""``tool_choice: "required"`` and a named function: grammar-constrained, as vLLM does them.

Neither needs the model to know a tool-call format: the output is constrained (a
``StructuredOutputParams`` JSON schema, compiled by ``runtime/structured_output/``) so that even
the bundled 19M model writes a call that validates, and the server turns it into ``tool_calls``:

- a named function: the output is the function's arguments object, its schema the function's
  ``parameters`` (no parameters: an object). It becomes one call to that function.
- ``"required"``: the output is a JSON array of ``{"name": ..., "parameters": {...}}`` objects, its
  items an ``anyOf`` over the tools (each ``name`` an ``enum`` of one), at least one item, at most
  one when ``parallel_tool_calls`` is false. Each tool's ``$defs`` are lifted to the top of the
  schema so that their ``#/$defs/...`` references still resolve.

Streamed, a named call starts at once and the output's text deltas are its arguments fragments;
a required array's calls start as each name is written, and their arguments follow as written.
"""

from __future__ import annotations

import json
from typing import Any

from oscar_compile.runtime.core.sampling_params import RequestError, StructuredOutputParams
from oscar_compile.runtime.server.tool_parsers.base import DeltaBuilder, ExtractedToolCalls, ToolCall, ToolCallStream
from oscar_compile.runtime.server.tool_parsers.json_calls import JsonCallsStream, StreamedCall, parse_call
from oscar_compile.runtime.server.tool_protocol import Tool

_NO_PARAMETERS = {"type": "object", "properties": {}}


def function_schema(tool: Tool) -> dict[str, Any]:
    """The schema of a named call's output: the function's arguments object."""
    return tool.function.parameters if tool.function.parameters is not None else dict(_NO_PARAMETERS)


def required_schema(tools: list[Tool], parallel_tool_calls: bool | None) -> dict[str, Any]:
    """The schema of a ``required`` output: an array of calls to any of ``tools``."""
    items, defs = [], {}
    for index, tool in enumerate(tools):
        parameters = dict(function_schema(tool))
        for name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                raise RequestError(
                    f"tools.{index}.function.parameters",
                    f"tools.{index}.function.parameters: "
                    f"$defs.{name} differs from another tool's definition of the same name",
                )
        items.append(
            {
                "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def constrained_output(schema: dict[str, Any]) -> StructuredOutputParams:
    """The constraint a forced tool choice puts on the output; its errors name ``tool_choice``."""
    return StructuredOutputParams(json=schema, param="tool_choice")


class NamedCall:
    """The output of a named ``tool_choice``: the arguments of one call to ``name``."""

    def __init__(self, name: str):
        self.name = name

    def extract(self, text: str) -> ExtractedToolCalls:
        return ExtractedToolCalls(None, [ToolCall(self.name, text)])

    def stream(self) -> ToolCallStream:
        return _NamedStream(self.name)


class _NamedStream(ToolCallStream):
    def __init__(self, name: str):
        self.call: ToolCall | None = None
        self.name = name

    @property
    def num_calls(self) -> int:
        return 1 if self.call is not None else 0

    def feed(self, text: str, final: bool = False) -> dict[str, Any]:
        out = DeltaBuilder()
        if self.call is None:
            self.call = ToolCall(self.name, "")
            out.start_call(0, self.call)
        if text:
            out.arguments(0, text)
        return out.delta()


class RequiredCalls:
    """The output of ``tool_choice: "required"``: a JSON array of ``{name, parameters}`` objects.
    One that does not parse (cut short by ``max_tokens``) is returned as content, with no calls."""

    def extract(self, text: str) -> ExtractedToolCalls:
        try:
            items = json.loads(text)
        except ValueError:
            return ExtractedToolCalls(text, [])
        # each call's arguments as written, so the whole answer equals what the stream sends
        calls = [parse_call(item, "parameters") for item in _item_texts(text)] if isinstance(items, list) else [None]
        if not calls or any(call is None for call in calls):
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(None, calls)

    def stream(self) -> ToolCallStream:
        return _RequiredStream()


def _item_texts(text: str) -> list[str]:
    """The text of each item of the JSON array ``text`` (known to parse), as written."""
    decoder, pos, items = json.JSONDecoder(), text.index("[") + 1, []
    while True:
        while text[pos] in " \t\n\r,":
            pos += 1
        if text[pos] == "]":
            return items
        _, end = decoder.raw_decode(text, pos)
        items.append(text[pos:end])
        pos = end


class _RequiredStream(JsonCallsStream):
    """Reads the array one object at a time: an object is whole once ``raw_decode`` takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""  # the whole output, sent as content if no call comes of it
        self.pending = ""  # what follows the last whole object (or the opening bracket)
        self.opened = False
        self._decoder = json.JSONDecoder()

    def feed(self, text: str, final: bool = False) -> dict[str, Any]:
        out = DeltaBuilder()
        self.text += text
        self.pending += text
        while self._step(out):
            pass
        if final and self.num_calls == 0:
            out.text(self.text)
        return out.delta()

    def _step(self, out: DeltaBuilder) -> bool:
        """Consume what can be; True when another step may consume more."""
        if not self.opened:
            stripped = self.pending.lstrip()
            if not stripped.startswith("["):
                return False
            self.pending, self.opened = stripped[1:], True
        if self.call is None:
            self.pending = self.pending.lstrip(" \t\n\r,")
            if not self.pending.startswith("{"):
                return False
            self.call = StreamedCall(self.started, "parameters")
        try:
            _, end = self._decoder.raw_decode(self.pending)
        except ValueError:
            self.call.feed(self.pending[len(self.call.text) :], out)
            return False
        self.call.feed(self.pending[len(self.call.text) : end], out)
        self.call.close(out)
        self.started += 1
        self.pending, self.call = self.pending[end:], None
        return True
