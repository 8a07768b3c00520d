"""Tool-call parsers, one module per model family's format, chosen by ``--tool-call-parser``."""

from __future__ import annotations

from oscar_compile.runtime.server.tool_parsers.base import ToolParser
from oscar_compile.runtime.server.tool_parsers.hermes import HermesToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {HermesToolParser.name: HermesToolParser}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name`` (ValueError listing the known ones otherwise)."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()
