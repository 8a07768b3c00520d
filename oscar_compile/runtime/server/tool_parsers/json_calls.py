"""One call written as a JSON object, ``{"name": ..., "<arguments key>": {...}}``, whole or as it
streams in. The Hermes format writes ``arguments``; a ``tool_choice: "required"`` output (a JSON
array of such objects, tool_choice.py) writes ``parameters``, as vLLM's schema for it does.

A call's ``arguments`` are the JSON text of its arguments object as the model wrote it, when it
wrote the name first and the arguments object next (what the formats ask for): then the streamed
fragments are that text piece by piece, and add up to exactly what the whole output gives. In
any other order, or with the arguments as a JSON string, they are re-serialized (``json.dumps``,
as vLLM does) and streamed in one fragment when the object closes.
"""

from __future__ import annotations

import json
import logging
import re

from oscar_compile.runtime.server.tool_parsers.base import DeltaBuilder, ToolCall, ToolCallStream

logger = logging.getLogger(__name__)

# the name, once it is written whole as the object's first key
_LEADING_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGUMENTS_KEY = {key: re.compile(rf'\s*,\s*"{key}"\s*:\s*') for key in ("arguments", "parameters")}
_DECODER = json.JSONDecoder()


def arguments_start(text: str, arguments_key: str) -> int | None:
    """Where the arguments object starts in ``text`` when the call writes its name first and its
    arguments object right after (None otherwise, or not yet)."""
    name = _LEADING_NAME.match(text)
    key = name and _ARGUMENTS_KEY[arguments_key].match(text, name.end())
    if not key or not text.startswith("{", key.end()):
        return None
    return key.end()


def parse_call(text: str, arguments_key: str) -> ToolCall | None:
    """The call ``text`` holds; None when it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    call = call_from_object(value, arguments_key)
    start = arguments_start(text, arguments_key)
    if call is not None and start is not None:  # the arguments as written
        _, end = _DECODER.raw_decode(text, start)
        call.arguments = text[start:end]
    return call


def call_from_object(value: object, arguments_key: str) -> ToolCall | None:
    """The call a decoded JSON value describes, its arguments re-serialized; None when it is not one."""
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
    name is written whole, then its arguments object goes out as it is written; whatever is left
    goes when the object closes."""

    def __init__(self, index: int, arguments_key: str):
        self.index = index
        self.arguments_key = arguments_key
        self.text = ""
        self.call: ToolCall | None = None
        self.sent = ""  # the arguments text sent so far
        self._arguments_done = False

    def feed(self, text: str, out: DeltaBuilder) -> None:
        self.text += text
        if self.call is None and (match := _LEADING_NAME.match(self.text)):
            self.call = ToolCall(json.loads(match.group(1)), "")
            out.start_call(self.index, self.call)
        if self.call is None or self._arguments_done:
            return
        start = arguments_start(self.text, self.arguments_key)
        if start is None:
            return
        try:  # an object decodes only once its closing brace is written
            end = _DECODER.raw_decode(self.text, start)[1]
            self._arguments_done = True
        except ValueError:
            end = len(self.text)  # all of it belongs to the (unfinished) arguments object
        self._send(self.text[start + len(self.sent) : end], out)

    def _send(self, fragment: str, out: DeltaBuilder) -> None:
        if fragment:
            out.arguments(self.index, fragment)
            self.sent += fragment

    def close(self, out: DeltaBuilder) -> bool:
        """Send what is left of the arguments; False when the object does not parse (the caller
        decides what the text becomes; a call already started keeps what it sent)."""
        parsed = parse_call(self.text, self.arguments_key)
        if parsed is None:
            if self.call is not None:
                logger.warning("tool call %d does not parse as a JSON call object: %.200r", self.index, self.text)
            return False
        if self.call is None:
            self.call = parsed
            out.start_call(self.index, parsed)
        if not parsed.arguments.startswith(self.sent):  # cannot happen: both read the same text
            logger.warning(
                "tool call %d: streamed arguments %.200r are not a prefix of %.200r",
                self.index,
                self.sent,
                parsed.arguments,
            )
            return True
        self._send(parsed.arguments[len(self.sent) :], out)
        self.call.arguments = parsed.arguments
        return True


class JsonCallsStream(ToolCallStream):
    """A stream whose calls are JSON objects written one after another (Hermes blocks, a
    ``required`` array), read by one ``StreamedCall`` at a time: a call counts as started once its
    name has gone out, so a half-written one that never names itself is no call."""

    def __init__(self) -> None:
        self.call: StreamedCall | None = None  # the open call
        self.started = 0  # calls closed with their name sent (or parsed)

    @property
    def num_calls(self) -> int:
        return self.started + (self.call is not None and self.call.call is not None)
