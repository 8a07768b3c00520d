"""OpenAI response bodies (completions and chat, whole and streamed) built from engine outputs.

Kept apart from the HTTP layer so the JSON shapes can be read - and changed - in one place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from oscar_compile.runtime.engine import RequestOutput, TokenLogprob


@dataclass
class Choice:
    """One choice accumulated over the deltas of its request."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_prompt_tokens = out.num_cached_prompt_tokens
        if out.finished:
            self.finish_reason = out.finish_reason


def usage(choices: list[Choice]) -> dict[str, Any]:
    prompt = sum(c.num_prompt_tokens for c in choices)
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_prompt_tokens for c in choices)}}


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class Formatter:
    """Builds bodies for one request: ``kind`` is "completion" or "chat"."""

    def __init__(self, kind: str, request_id: str, created: int, model: str, tokenizer,
                 want_logprobs: bool):
        self.kind = kind
        self.request_id = request_id
        self.created = created
        self.model = model
        self.tokenizer = tokenizer
        self.want_logprobs = want_logprobs

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _logprobs(self, entries: list[TokenLogprob], text_offset: int = 0) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        if self.kind == "chat":
            return {"content": [self._chat_logprob(e) for e in entries]}
        tokens = [self._token_text(e.token_id) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._token_text(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}

    def _chat_logprob(self, entry: TokenLogprob) -> dict[str, Any]:
        def one(token_id: int, logprob: float) -> dict[str, Any]:
            token = self._token_text(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
        return {**one(entry.token_id, entry.logprob), "top_logprobs": [one(t, lp) for t, lp in entry.top]}

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def full(self, choices: list[Choice]) -> dict[str, Any]:
        """The non-streaming body."""
        bodies = []
        for c in choices:
            body: dict[str, Any] = {"index": c.index, "logprobs": self._logprobs(c.logprobs),
                                    "finish_reason": c.finish_reason}
            if self.kind == "chat":
                body["message"] = {"role": "assistant", "content": c.text}
            else:
                body["text"] = c.text
            bodies.append(body)
        return {**self._envelope(bodies, chunk=False), "usage": usage(choices)}

    def chunk(self, index: int, out: RequestOutput | None, text_offset: int = 0,
              first: bool = False) -> dict[str, Any] | None:
        """A streamed delta, or None when it carries nothing (text held back, no logprobs)."""
        text = out.new_text if out is not None else ""
        finish = out.finish_reason if out is not None and out.finished else None
        entries = out.new_logprobs if out is not None else []
        if not (text or finish or first or (self.want_logprobs and entries)):
            return None
        body: dict[str, Any] = {"index": index, "logprobs": self._logprobs(entries, text_offset),
                                "finish_reason": finish}
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta["content"] = text
            body["delta"] = delta
        else:
            body["text"] = text
        return self._envelope([body], chunk=True)

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        return {**self._envelope([], chunk=True), "usage": usage(choices)}


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
