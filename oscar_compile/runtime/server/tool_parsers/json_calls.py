"""One call written as a JSON object, ``{"name": ..., "<arguments key>": {...}}``, whole or as it
streams in. The Hermes format writes ``arguments``; a ``tool_choice: "required"`` output (a JSON
array of such objects, tool_choice.py) writes ``parameters``, as vLLM's schema for it does."""

from __future__ import annotations

import json
import logging
import re

from oscar_compile.runtime.server.tool_parsers.base import DeltaBuilder, ToolCall

logger = logging.getLogger(__name__)

# the name, once it is written whole as the object's first key
_LEADING_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')


def parse_call(text: str, arguments_key: str) -> ToolCall | None:
    """The call ``text`` holds, its arguments re-serialized as JSON text; None when it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return call_from_object(value, arguments_key)


def call_from_object(value: object, arguments_key: str) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        return ToolCall(value["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class StreamedCall:
    """One call's object as its text arrives: the call starts (id, type, name) as soon as the
    name is written whole, and its arguments go out in one fragment when the object closes."""

    def __init__(self, index: int, arguments_key: str):
        self.index = index
        self.arguments_key = arguments_key
        self.text = ""
        self.call: ToolCall | None = None

    def feed(self, text: str, out: DeltaBuilder) -> None:
        self.text += text
        if self.call is None and (match := _LEADING_NAME.match(self.text)):
            self.call = ToolCall(json.loads(match.group(1)), "")
            out.start_call(self.index, self.call)

    def close(self, out: DeltaBuilder) -> bool:
        """Send the arguments; False when the object does not parse (the caller decides what the
        text becomes; a call already started keeps empty arguments)."""
        parsed = parse_call(self.text, self.arguments_key)
        if parsed is None:
            if self.call is not None:
                logger.warning("tool call %d does not parse as a JSON call object: %.200r", self.index, self.text)
            return False
        if self.call is None:
            self.call = parsed
            out.start_call(self.index, parsed)
        self.call.arguments = parsed.arguments
        out.arguments(self.index, parsed.arguments)
        return True
