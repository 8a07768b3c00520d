"""``--tool-call-parser hermes``: the Hermes 2 Pro / Qwen2.5 / Qwen3 format, which the bundled
model's chat template teaches too::

    some text
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

As vLLM's ``hermes`` parser reads it: the content is the text before the first ``<tool_call>``
(None when only whitespace); every block, the last one possibly unclosed (the output ran out),
must hold a JSON object with a string ``name`` and object ``arguments``, or the whole output is
content and there are no calls. Text after the first call is dropped.

Streamed, plain text goes out as it comes, except a tail that may begin ``<tool_call>`` and
trailing whitespace, held until the next delta says what they are; a call starts once its name
is written whole and its arguments object follows as it is written (json_calls.py). A block that
does not parse goes out as content, unless its name was already sent (its arguments then stay
what was sent).
"""

from __future__ import annotations

import re
from typing import Any

from oscar_compile.runtime.server.tool_parsers.base import (
    DeltaBuilder,
    ExtractedToolCalls,
    ToolCallStream,
    ToolParser,
)
from oscar_compile.runtime.server.tool_parsers.json_calls import JsonCallsStream, StreamedCall, parse_call

START, END = "<tool_call>", "</tool_call>"
_BLOCKS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


def _held_back(text: str, tag: str, whitespace: bool) -> int:
    """How many trailing characters of ``text`` to hold: the longest start of ``tag`` it ends
    with, and (``whitespace``) the whitespace before that."""
    partial = next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)
    before = text[: len(text) - partial]
    return partial + (len(before) - len(before.rstrip()) if whitespace else 0)


class HermesToolParser(ToolParser):
    name = "hermes"

    def extract(self, text: str) -> ExtractedToolCalls:
        first = text.find(START)
        if first < 0:
            return ExtractedToolCalls(text, [])
        calls = [parse_call(closed or open_, "arguments") for closed, open_ in _BLOCKS.findall(text)]
        if any(call is None for call in calls):
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(text[:first].rstrip() or None, calls)

    def stream(self) -> ToolCallStream:
        return _HermesStream()


class _HermesStream(JsonCallsStream):
    """``call`` is the open ``<tool_call>`` block."""

    def __init__(self) -> None:
        super().__init__()
        self.pending = ""  # text not yet sent or given to a call
        self.seen_call = False  # text after the first <tool_call> is dropped

    def feed(self, text: str, final: bool = False) -> dict[str, Any]:
        out = DeltaBuilder()
        self.pending += text
        self._drain(out, final)
        return out.delta()

    def _drain(self, out: DeltaBuilder, final: bool) -> None:
        while True:
            if self.call is None:
                start = self.pending.find(START)
                if start < 0:
                    keep = 0 if final else _held_back(self.pending, START, whitespace=True)
                    self._text(out, self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                    return
                self._text(out, self.pending[:start].rstrip())
                self.pending = self.pending[start + len(START) :]
                self.call, self.seen_call = StreamedCall(self.started, "arguments"), True
                continue
            end = self.pending.find(END)
            if end < 0:
                keep = 0 if final else _held_back(self.pending, END, whitespace=False)
                self.call.feed(self.pending[: len(self.pending) - keep], out)
                self.pending = self.pending[len(self.pending) - keep :]
                if final:
                    self._close(out, closed=False)
                return
            self.call.feed(self.pending[:end], out)
            self.pending = self.pending[end + len(END) :]
            self._close(out, closed=True)

    def _text(self, out: DeltaBuilder, text: str) -> None:
        if not self.seen_call:
            out.text(text)

    def _close(self, out: DeltaBuilder, closed: bool) -> None:
        call, self.call = self.call, None
        if call.close(out) or call.call is not None:
            self.started += 1
        elif self.started == 0:  # nothing sent as a call yet: the block was text after all
            self.seen_call = False
            out.text(START + call.text + (END if closed else ""))
