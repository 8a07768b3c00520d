"""What the HTTP server lets in and how long it holds it: keys, sizes, queues, deadlines.

Kept apart from the engine's settings (``EngineConfig``): these bound what clients may ask of
the server, not how the engine runs. The defaults are what ``python -m
oscar_compile.runtime.serve`` uses and what the README's serve options document.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # a 128k-token prompt as JSON token ids is ~1 MB
DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
# Chat requests without max_tokens generate up to the end of the context, as OpenAI's API does,
# but never more than this: on a 40k-token context one such request would hold a slot for minutes.
DEFAULT_CHAT_MAX_TOKENS = 4096


@dataclass
class ServerConfig:
    """``api_key``: required as ``Authorization: Bearer`` on every ``/v1/*`` route (None: open).
    ``metrics_require_key``: ``/metrics`` needs the key too (``/health`` never does).
    ``max_body_bytes``: larger request bodies get 413.
    ``max_waiting_requests``: with this many requests already queued for admission, a new one
    gets 503 with ``Retry-After`` (None: unbounded).
    ``request_timeout_s``: a request still running after this long (queueing included) is
    aborted, its pages freed, and answered 408 (None: no deadline).
    ``shutdown_timeout_s``: on SIGTERM / SIGINT, how long in-flight requests may finish.
    ``default_chat_max_tokens``: the ``max_tokens`` of a chat request that gives none (capped by
    the room left in the context); completions keep OpenAI's legacy default of 16.
    ``strict_fields``: an unknown request field is a 400 (by default it is ignored, logged and
    counted, as vLLM does).
    ``chat_template``: the Jinja chat template to render messages with, in place of the
    tokenizer's (None: the tokenizer's).
    ``tool_call_parser``: how ``tool_choice: "auto"`` outputs are read for calls (a name of
    ``tool_parsers.TOOL_PARSERS``: ``hermes``); ``enable_auto_tool_choice``: allow ``"auto"``
    (it needs a parser), as vLLM's ``--enable-auto-tool-choice``.
    """

    api_key: str | None = None
    metrics_require_key: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS
    request_timeout_s: float | None = None
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    default_chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS
    strict_fields: bool = False
    chat_template: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset for an open server)")
        if self.metrics_require_key and self.api_key is None:
            raise ValueError("metrics_require_key needs an api_key")
        for name in ("max_body_bytes", "default_chat_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (--tool-call-parser)")
        if self.tool_call_parser is not None:
            from oscar_compile.runtime.server.tool_parsers import TOOL_PARSERS

            if self.tool_call_parser not in TOOL_PARSERS:
                raise ValueError(
                    f"unknown tool_call_parser {self.tool_call_parser!r}; known: {', '.join(sorted(TOOL_PARSERS))}"
                )
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
