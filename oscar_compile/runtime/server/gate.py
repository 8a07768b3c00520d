"""Checks made before a handler sees a request: the API key, then the body size.

Plain ASGI middleware rather than FastAPI dependencies: they must cover every path, unknown ones
included (an unauthenticated client learns nothing about the routes, not even a 404), and they
must answer before the body is read (a 401 costs the server no upload; a declared 4 GB body is
refused from its headers).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from oscar_compile.runtime.server.responses import error_body

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Past the limit we keep reading (and dropping) up to this much more before answering 413, so
# the client finishes its upload and reads the reply; closing on unread data would make the
# kernel reset the connection and the client would see no reply at all.
_DRAIN_BYTES = 4 * 1024 * 1024


async def send_error(send: Send, status: int, message: str, type_: str, code: str | None = None,
                     headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(message, type_, None, code)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def _digest(value: bytes) -> bytes:
    # compare fixed-length digests: compare_digest on the raw strings would leak the key's length
    return hashlib.sha256(value).digest()


def bearer_token(scope: Scope) -> bytes | None:
    """The token of the first ``Authorization: Bearer <token>`` header, or None."""
    for name, value in scope.get("headers", []):
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() != b"bearer" or not token.strip():
                return None
            return token.strip()
    return None


class ApiKeyGate:
    """401 for a missing or wrong key on ``/v1/*`` (and ``/metrics`` when asked to)."""

    def __init__(self, app: ASGIApp, api_key: str, metrics_require_key: bool = False):
        self.app = app
        self._key_digest = _digest(api_key.encode())
        self._metrics_require_key = metrics_require_key

    def _protected(self, path: str) -> bool:
        return path == "/v1" or path.startswith("/v1/") or (self._metrics_require_key and path == "/metrics")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._protected(scope.get("path", "")):
            return await self.app(scope, receive, send)
        token = bearer_token(scope)
        if token is not None and hmac.compare_digest(_digest(token), self._key_digest):
            return await self.app(scope, receive, send)
        message = ("Incorrect API key provided." if token is not None else
                   "You didn't provide an API key: send it as the header 'Authorization: Bearer KEY'.")
        await send_error(send, 401, message, "invalid_request_error", "invalid_api_key",
                         {"WWW-Authenticate": "Bearer"})


class BodyLimit:
    """413 for a request body over ``max_bytes``, declared (Content-Length) or sent (chunked).

    The body is read here and replayed to the app; after it, ``receive`` is the server's own,
    so handlers still see ``http.disconnect`` when the client leaves.
    """

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            if declared <= self.max_bytes + _DRAIN_BYTES:
                await self._drain(receive, declared)
            return await self._too_large(send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                if more:
                    await self._drain(receive, self.max_bytes + _DRAIN_BYTES - size)
                return await self._too_large(send)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _drain(receive: Receive, budget: int) -> None:
        more = True
        while more and budget > 0:
            message = await receive()
            if message["type"] != "http.request":
                return
            budget -= len(message.get("body", b""))
            more = message.get("more_body", False)

    async def _too_large(self, send: Send) -> None:
        await send_error(send, 413, f"the request body is larger than this server's limit of "
                         f"{self.max_bytes} bytes", "invalid_request_error", "request_too_large")


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
