"""What a tool-call parser returns, whole and streamed, in OpenAI's shapes.

A parser reads the calls a model wrote in its own format (``--tool-call-parser``; hermes.py for
the Hermes / Qwen ``<tool_call>`` JSON) out of the generated text. Streamed, it turns each text
delta into the fields of one chunk's ``delta``: ``content`` for plain text, ``tool_calls`` entries
keyed by the call's ``index``. A call's first entry carries ``id``, ``type`` and the function's
name (``arguments`` ""), later ones ``arguments`` fragments, as OpenAI streams them; when both
fall in one delta they are merged into one entry, so a chunk never holds two entries of one index.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


def tool_call_id() -> str:
    """A fresh call id, in vLLM's form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=tool_call_id)

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    """A whole output split into its text (None when there is none) and its calls."""

    content: str | None
    calls: list[ToolCall]


class DeltaBuilder:
    """The ``delta`` fields of one chunk, built up from text and call events."""

    def __init__(self) -> None:
        self.content = ""
        self.entries: dict[int, dict[str, Any]] = {}

    def text(self, text: str) -> None:
        self.content += text

    def start_call(self, index: int, call: ToolCall) -> None:
        self.entries[index] = {
            "index": index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }

    def arguments(self, index: int, fragment: str) -> None:
        entry = self.entries.setdefault(index, {"index": index, "function": {}})
        entry["function"]["arguments"] = entry["function"].get("arguments", "") + fragment

    def delta(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"content": self.content} if self.content else {}
        if self.entries:
            fields["tool_calls"] = [self.entries[i] for i in sorted(self.entries)]
        return fields


class ToolCallStream(ABC):
    """One streamed choice: text deltas in, ``delta`` fields out."""

    @abstractmethod
    def feed(self, text: str, final: bool = False) -> dict[str, Any]:
        """The delta fields ``text`` completes (empty: nothing to send yet); ``final``: the output
        ends with ``text``, so nothing is held back."""

    @property
    @abstractmethod
    def num_calls(self) -> int:
        """Calls started so far."""


class ToolParser(ABC):
    """Reads one model family's tool-call format (one module each, chosen by ``--tool-call-parser``)."""

    name: str

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls in a whole output; none, and the whole text as content, when they do not parse."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh streaming state for one choice."""
