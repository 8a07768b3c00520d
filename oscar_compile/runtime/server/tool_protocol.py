"""OpenAI's tool fields of a chat request: ``tools``, ``tool_choice``, ``parallel_tool_calls``, and
the assistant ``tool_calls`` of a history, validated as OpenAI and vLLM validate them.

- ``tools`` holds functions only (``type: "function"``); a name is OpenAI's ``[a-zA-Z0-9_-]{1,64}``
  and unique in the list; ``parameters`` is a JSON schema object (absent: no arguments);
  ``strict`` is accepted (``required`` and named choices are grammar-constrained, strict or not).
- ``tool_choice``: ``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function", "function":
  {"name": ...}}`` naming one of ``tools``. Without it, it is ``"auto"`` when tools are given and
  ``"none"`` otherwise (vLLM's default). Any choice but ``"none"`` needs ``tools``; an empty
  ``tools`` array is a 400 (OpenAI's and current vLLM's answer).
- Every error names its field: ``tools.0.function.name``, ``tool_choice.function.name``...
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import Field

from oscar_compile.runtime.core.sampling_params import RequestError
from oscar_compile.runtime.server.strict_model import StrictModel

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_TOOLS = 128  # OpenAI's limit on the tools of one request


class FunctionDefinition(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI returns it


class AssistantToolCall(StrictModel):
    """A call an assistant turn of the history made (what the server returned earlier)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def as_template_dict(self) -> dict[str, Any]:
        """The call for the chat template, its arguments parsed into an object when they are JSON
        (vLLM does the same: templates write ``arguments | tojson`` or iterate over them)."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": self.type, "function": {"name": self.function.name, "arguments": arguments}}


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(StrictModel):
    """The tool fields of ``ChatCompletionRequest`` (mixed into it)."""

    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``tool_choice`` with vLLM's default: ``"auto"`` when tools are given, else ``"none"``."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def check_tools(self) -> None:
        if self.tools is not None and not self.tools:
            raise RequestError("tools", "tools must not be an empty array: give at least one tool or leave it out")
        seen: set[str] = set()
        for index, tool in enumerate(self.tools or []):
            name = tool.function.name
            if not _NAME.fullmatch(name):
                raise RequestError(
                    f"tools.{index}.function.name",
                    f"tools.{index}.function.name must be 1 to 64 "
                    f"characters of a-z, A-Z, 0-9, underscores and dashes, got {name!r}",
                )
            if name in seen:
                raise RequestError(
                    f"tools.{index}.function.name", f"tools.{index}.function.name: two tools are named {name!r}"
                )
            seen.add(name)
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise RequestError("tool_choice", "tool_choice other than 'none' needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in seen:
            raise RequestError(
                "tool_choice.function.name",
                f"tool_choice names the function {choice.function.name!r}, which is not in tools",
            )

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template (rendered whatever ``tool_choice`` says, ``"none"``
        included, as vLLM renders them)."""
        return template_tools(self.tools)


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """OpenAI tool objects for the chat template's ``tools`` variable, as the client sent them
    (None: no tools, so a template renders a plain chat)."""
    if not tools:
        return None
    return [tool.model_dump(exclude_none=True, exclude_unset=True) for tool in tools]
