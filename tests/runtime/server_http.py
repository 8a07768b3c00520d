"""Loopback HTTP helpers for the server tests: serve an app in a thread, plain requests.

Plain ``http.client`` rather than the code under test (bench/load_client.py) or the ``openai``
client, so a failure says what went over the wire.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time

import uvicorn

from oscar_compile.runtime.async_engine import AsyncEngine


@contextlib.contextmanager
def running(app):
    """Serve ``app`` on a free loopback port in a thread; yields the port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # a free port, held until uvicorn takes the socket over
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1]
    finally:
        uv.should_exit = True
        thread.join(10)


def post(port: int, path: str, body: bytes | dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = json.loads(response.read())
    conn.close()
    return response.status, payload


def get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    return response.status, text


def wait_idle(async_engine: AsyncEngine, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = async_engine.stats
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["quant_pages_used"] == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"engine still busy: {async_engine.stats}")


def stream_events(port: int, path: str, body: dict, headers: dict | None = None) -> tuple[int, list[str]]:
    """POST a streaming request and read it to the end: (status, the ``data:`` payloads)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    events = [chunk[len("data: "):] for chunk in text.split("\n\n") if chunk.startswith("data: ")]
    return response.status, events
