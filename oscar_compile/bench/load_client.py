"""One completions request over a raw asyncio connection, timed token by token.

Why not an HTTP library: the load generator must hang up mid-stream at a chosen event (the
fault it injects), time every server-sent event as it arrives, and add no dependency to the
``serve`` extra. HTTP/1.1 with ``Content-Length`` bodies and chunked or sized replies is all the
server speaks, and all this needs.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """What one request saw. ``outcome``: "completed", "disconnected" (hung up on purpose) or
    "error" (``error`` says which: ``http_<status>``, ``stream_<type>``, ``connection``...)."""

    stream: bool
    num_prompt_tokens: int
    max_tokens: int
    outcome: str = "error"
    error: str | None = None
    detail: str | None = None  # the server's error message, cut short
    start: float = 0.0
    end: float = 0.0
    event_times: list[float] = field(default_factory=list)  # arrival of each event with new text
    num_output_tokens: int = 0

    @property
    def latency_s(self) -> float:
        return self.end - self.start

    @property
    def ttft_s(self) -> float | None:
        return self.event_times[0] - self.start if self.event_times else None

    def inter_token_s(self) -> list[float]:
        return [b - a for a, b in zip(self.event_times, self.event_times[1:], strict=False)]


class _Reply:
    """Reads one HTTP/1.1 reply: status, headers, then the body chunk by chunk."""

    def __init__(self, reader: asyncio.StreamReader):
        self.reader = reader
        self.status = 0
        self.headers: dict[str, str] = {}

    async def read_head(self) -> None:
        line = await self.reader.readline()
        parts = line.split()
        if len(parts) < 2:
            raise ConnectionError("no status line")
        self.status = int(parts[1])
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b"\n", b""):
                return
            name, _, value = line.decode("latin-1").partition(":")
            self.headers[name.strip().lower()] = value.strip()

    async def chunks(self):
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self.reader.readline()).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    await self.reader.readline()
                    return
                yield await self.reader.readexactly(size)
                await self.reader.readexactly(2)  # CRLF after each chunk
        elif "content-length" in self.headers:
            yield await self.reader.readexactly(int(self.headers["content-length"]))
        else:
            yield await self.reader.read()


async def get(host: str, port: int, path: str, api_key: str | None = None, timeout: float = 30.0) -> tuple[int, str]:
    """A plain GET (``/metrics``, ``/health``): (status, body text)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Connection: close\r\n\r\n".encode())
        reply = _Reply(reader)
        await asyncio.wait_for(reply.read_head(), timeout)
        body = b"".join([chunk async for chunk in reply.chunks()])
        return reply.status, body.decode()
    finally:
        writer.close()


async def complete(host: str, port: int, body: dict, record: RequestRecord, api_key: str | None = None,
                   hang_up_after: int | None = None, timeout: float = 600.0) -> RequestRecord:
    """POST ``body`` to /v1/completions and fill ``record``; with ``hang_up_after`` (streams
    only), drop the connection once that many events with text have arrived."""
    record.start = time.perf_counter()
    try:
        await asyncio.wait_for(_complete(host, port, body, record, api_key, hang_up_after), timeout)
    except asyncio.TimeoutError:
        record.outcome, record.error = "error", "client_timeout"
    except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError) as err:
        record.outcome, record.error = "error", f"connection:{type(err).__name__}"
    record.end = time.perf_counter()
    return record


async def _complete(host, port, body, record, api_key, hang_up_after) -> None:
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        writer.write((f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                      f"{auth}Content-Length: {len(data)}\r\n\r\n").encode() + data)
        reply = _Reply(reader)
        await reply.read_head()
        if reply.status != 200:
            record.outcome, record.error = "error", f"http_{reply.status}"
            text = b"".join([chunk async for chunk in reply.chunks()]).decode(errors="replace")
            record.detail = _error_message(text)[:300]
            return
        if not record.stream:
            payload = json.loads(b"".join([chunk async for chunk in reply.chunks()]))
            record.num_output_tokens = payload["usage"]["completion_tokens"]
            record.outcome = "completed"
            return
        await _read_events(reply, record, hang_up_after)
    finally:
        if record.outcome == "disconnected":
            writer.transport.abort()  # a reset, as a client that vanishes
        else:
            writer.close()


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text


async def _read_events(reply: _Reply, record: RequestRecord, hang_up_after: int | None) -> None:
    buffer = b""
    async for chunk in reply.chunks():
        buffer += chunk
        *events, buffer = buffer.split(b"\n\n")
        now = time.perf_counter()
        for event in events:
            if not event.startswith(b"data: "):
                continue
            data = event[len(b"data: "):]
            if data == b"[DONE]":
                record.outcome = "error" if record.error else "completed"
                return
            payload = json.loads(data)
            if "error" in payload:  # the server failed the request after the headers went out
                record.error = f"stream_{payload['error'].get('type')}"
                record.detail = str(payload["error"].get("message"))[:300]
                continue
            if payload.get("usage"):
                record.num_output_tokens = payload["usage"]["completion_tokens"]
            if any(choice.get("text") for choice in payload.get("choices", [])):
                record.event_times.append(now)
                if hang_up_after is not None and len(record.event_times) >= hang_up_after:
                    record.outcome = "disconnected"
                    record.num_output_tokens = len(record.event_times)  # about one token per event
                    return
    raise ConnectionError("the stream ended without [DONE]")
