"""OpenAI response bodies (completions and chat, whole and streamed) built from engine outputs.

Kept apart from the HTTP layer so the JSON shapes can be read - and changed - in one place.

Prompt scoring follows vLLM's shapes: with ``echo`` a completion's text starts with the decoded
prompt, and its ``logprobs`` start with one entry per prompt token (the first ``null`` in
``token_logprobs`` and ``top_logprobs``: nothing predicts it); a prompt entry's ``top_logprobs``
holds the k best tokens and the prompt token itself. ``prompt_logprobs`` (a completion choice's
field; a chat response's top-level field) is a list aligned with the prompt, the first entry
``null``, each other a dict ``token id -> {logprob, rank, decoded_token}`` of the prompt token and
the k best.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from oscar_compile.runtime.engine import RequestOutput, TokenLogprob
from oscar_compile.runtime.server.tool_calls import ChoiceToolStream, ToolCallPlan


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
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_prompt_tokens = out.num_cached_prompt_tokens
        if out.finished:
            self.finish_reason = out.finish_reason


def usage(choices: list[Choice], n: int = 1) -> dict[str, Any]:
    """Each prompt's tokens once (its ``n`` choices are consecutive), every choice's completion."""
    prompt = sum(c.num_prompt_tokens for c in choices[::n])
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_prompt_tokens for c in choices[::n])}}


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class Formatter:
    """Builds bodies for one request: ``kind`` is "completion" or "chat"; ``n`` choices per prompt."""

    def __init__(self, kind: str, request_id: str, created: int, model: str, tokenizer,
                 want_logprobs: bool, echo: bool = False, prompt_logprobs: int | None = None,
                 tool_calls: ToolCallPlan | None = None, n: int = 1):
        self.kind = kind
        self.request_id = request_id
        self.created = created
        self.model = model
        self.tokenizer = tokenizer
        self.want_logprobs = want_logprobs
        self.echo = echo  # completions: the prompt (and its logprobs) before the completion
        self.prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs: k, or None for none
        self.tool_calls = tool_calls  # chat: the output is read for tool calls (tool_calls.py)
        self._tool_streams: dict[int, ChoiceToolStream] = {}  # per streamed choice
        self.n = n

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _logprobs(self, entries: list[TokenLogprob], text_offset: int = 0,
                  prompt: tuple[list[int], list[TokenLogprob | None]] | None = None) -> dict[str, Any] | None:
        """The ``logprobs`` field; ``prompt``: (ids, their logprobs) of an echoed prompt, first."""
        if not self.want_logprobs:
            return None
        if self.kind == "chat":
            return {"content": [self._chat_logprob(e) for e in entries]}
        tokens, token_logprobs, top_logprobs = [], [], []
        for token_id, entry in zip(*prompt, strict=True) if prompt is not None else ():
            tokens.append(self._token_text(token_id))
            token_logprobs.append(None if entry is None else entry.logprob)
            top_logprobs.append(None if entry is None else self._top_with_token(entry))
        tokens += [self._token_text(e.token_id) for e in entries]
        token_logprobs += [e.logprob for e in entries]
        top_logprobs += [{self._token_text(t): lp for t, lp in e.top} for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def _top_with_token(self, entry: TokenLogprob) -> dict[str, float]:
        """A prompt position's k best and the prompt token itself (vLLM's echo entries)."""
        top = {self._token_text(t): lp for t, lp in entry.top}
        if entry.token_id not in {t for t, _ in entry.top}:
            top.setdefault(self._token_text(entry.token_id), entry.logprob)
        return top

    def _prompt_logprobs(self, entries: list[TokenLogprob | None] | None) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token, ``{id: {logprob, rank, decoded_token}}``."""
        result: list[dict[str, Any] | None] = []
        for entry in entries or []:
            if entry is None:
                result.append(None)
                continue
            ranked = {t: (lp, rank) for rank, (t, lp) in enumerate(entry.top[:self.prompt_logprobs], start=1)}
            ranked.setdefault(entry.token_id, (entry.logprob, entry.rank))
            result.append({str(t): {"logprob": lp, "rank": rank, "decoded_token": self._token_text(t)}
                           for t, (lp, rank) in ranked.items()})
        return result

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
            prompt = (c.prompt_token_ids, c.prompt_logprobs or [None] * len(c.prompt_token_ids)) if self.echo else None
            body: dict[str, Any] = {"index": c.index, "logprobs": self._logprobs(c.logprobs, prompt=prompt),
                                    "finish_reason": c.finish_reason}
            if self.kind == "chat" and self.tool_calls is not None:
                body["message"], body["finish_reason"] = self.tool_calls.message(c.text, c.finish_reason)
            elif self.kind == "chat":
                body["message"] = {"role": "assistant", "content": c.text}
            else:
                body["text"] = (self.tokenizer.decode(c.prompt_token_ids) if self.echo else "") + c.text
                if self.prompt_logprobs is not None:
                    body["prompt_logprobs"] = self._prompt_logprobs(c.prompt_logprobs)
            bodies.append(body)
        whole = {**self._envelope(bodies, chunk=False), "usage": usage(choices, self.n)}
        if self.kind == "chat" and self.prompt_logprobs is not None:  # vLLM: top level, the one prompt's
            whole["prompt_logprobs"] = self._prompt_logprobs(choices[0].prompt_logprobs if choices else None)
        return whole

    def echo_offset(self, choice: Choice) -> int:
        """Where a completion's generated tokens start in ``text_offset`` terms: after the echoed
        prompt's tokens (0 without ``echo``)."""
        return sum(len(self._token_text(t)) for t in choice.prompt_token_ids) if self.echo else 0

    def chunk(self, index: int, out: RequestOutput | None, text_offset: int = 0,
              first: bool = False, prompt: Choice | None = None) -> dict[str, Any] | None:
        """A streamed delta, or None when it carries nothing (text held back, no logprobs).
        ``prompt``: the choice whose first completion chunk this is (it carries the echoed
        prompt and the prompt logprobs, as vLLM streams them)."""
        text = out.new_text if out is not None else ""
        finish = out.finish_reason if out is not None and out.finished else None
        entries = out.new_logprobs if out is not None else []
        if self.kind != "completion" or not (self.echo or self.prompt_logprobs is not None):
            prompt = None  # nothing of the prompt to send
        scored = None
        if prompt is not None and self.echo:
            text = self.tokenizer.decode(prompt.prompt_token_ids) + text
            text_offset = 0
            scored = (prompt.prompt_token_ids, prompt.prompt_logprobs or [None] * len(prompt.prompt_token_ids))
        if not (text or finish or first or prompt is not None or (self.want_logprobs and entries)):
            return None
        body: dict[str, Any] = {"index": index, "logprobs": self._logprobs(entries, text_offset, prompt=scored),
                                "finish_reason": finish}
        if prompt is not None and self.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(prompt.prompt_logprobs)
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta["content"] = text
            if self.tool_calls is not None and not first:
                if index not in self._tool_streams:
                    self._tool_streams[index] = self.tool_calls.stream()
                stream = self._tool_streams[index]
                delta = stream.feed(text, final=finish is not None)
                body["finish_reason"] = self.tool_calls.finish_reason(finish, stream.called)
                if not (delta or finish or (self.want_logprobs and entries)):
                    return None  # held back: it may open a tool call
            body["delta"] = delta
        else:
            body["text"] = text
        return self._envelope([body], chunk=True)

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        return {**self._envelope([], chunk=True), "usage": usage(choices, self.n)}


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
