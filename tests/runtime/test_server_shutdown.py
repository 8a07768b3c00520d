"""SIGTERM / SIGINT on the real serve process while clients stream.

Signals reach only a main thread, so each test runs ``python -m oscar_compile.runtime.serve`` as
a child process on the tiny model directory. Nothing may be lost: every admitted stream either
completes or ends with an error event, the process exits 0, and its last log line says that no
KV page is in use.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from oscar_compile.bench.load_server import FINAL_LINE

pytest.importorskip("uvicorn")

LONG = {"prompt": "hello", "max_tokens": 480, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}


class ServeProcess:
    def __init__(self, model_dir, *args: str):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "oscar_compile.runtime.serve", "--model", str(model_dir), "--device", "cpu",
               "--kv-memory", "0.01", "--port", str(self.port), "--max-num-batched-tokens", "64", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 120
        while not self._healthy():
            assert self.proc.poll() is None, self.proc.stderr.read()
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)

    def _healthy(self) -> bool:
        try:
            return self.get("/health")[0] == 200
        except OSError:
            return False

    def get(self, path: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()

    def post(self, body: dict) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())

    def open_stream(self, body: dict = LONG) -> http.client.HTTPResponse:
        """An admitted stream: the status line has arrived."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        return response

    def finish(self, timeout: float = 60) -> tuple[int, str]:
        try:
            _, err = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return self.proc.returncode, err


def read_stream(response: http.client.HTTPResponse) -> list[str]:
    """Every ``data:`` payload until the server ends the stream."""
    return [line[len(b"data: "):].decode().strip() for line in response.read().split(b"\n\n")
            if line.startswith(b"data: ")]


def outcome(events: list[str]) -> tuple[str, int]:
    """("completed", tokens) or ("error", tokens streamed before it); asserts the stream ended well."""
    assert events and events[-1] == "[DONE]", events[-3:]
    bodies = [json.loads(e) for e in events[:-1]]
    if "error" in bodies[-1]:
        return "error", len(bodies) - 1
    assert bodies[-1]["usage"] is not None
    return "completed", bodies[-1]["usage"]["completion_tokens"]


def final_stats(log: str) -> tuple[int, ...]:
    match = FINAL_LINE.findall(log)
    assert match, log[-2000:]
    return tuple(int(x) for x in match[-1])


def read_all_in_threads(responses):
    """Read every stream on its own thread; a stream the server cut holds the exception."""
    results: list[list[str] | Exception | None] = [None] * len(responses)

    def read(i):
        try:
            results[i] = read_stream(responses[i])
        except (http.client.HTTPException, OSError) as err:
            results[i] = err
    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(responses))]
    for t in threads:
        t.start()
    return results, threads


def test_sigterm_finishes_the_streams_in_flight_refuses_new_ones_and_exits_0(model_dir):
    server = ServeProcess(model_dir, "--max-num-seqs", "1", "--shutdown-timeout", "60")
    body = {**LONG, "max_tokens": 160}  # run one at a time: 640 tokens, seconds after the signal
    streams = [server.open_stream(body) for _ in range(4)]
    results, threads = read_all_in_threads(streams)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    status, body = server.post({"prompt": "new", "max_tokens": 2})
    assert status == 503 and body["error"]["code"] == "shutting_down"
    assert server.get("/health")[0] == 503
    for t in threads:
        t.join(60)
    code, log = server.finish()
    assert code == 0, log[-2000:]
    assert [outcome(events) for events in results] == [("completed", 160)] * 4
    admitted, refused, finished, aborted, window_used, quant_used = final_stats(log)
    assert (admitted, finished, aborted, window_used, quant_used) == (4, 4, 0, 0, 0) and refused >= 1


def test_past_the_shutdown_timeout_requests_are_aborted_with_an_error_and_pages_freed(model_dir):
    server = ServeProcess(model_dir, "--max-num-seqs", "2", "--shutdown-timeout", "0.5")
    streams = [server.open_stream() for _ in range(5)]
    results, threads = read_all_in_threads(streams)
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    code, log = server.finish()
    assert code == 0, log[-2000:]
    assert time.monotonic() - started < 15
    outcomes = [outcome(events) for events in results]
    assert all(kind in ("completed", "error") for kind, _ in outcomes)
    assert any(kind == "error" for kind, _ in outcomes)  # 5 x 480 tokens do not finish in 0.5 s
    for events, (kind, _) in zip(results, outcomes, strict=True):
        if kind == "error":
            assert json.loads(events[-2])["error"]["type"] == "service_unavailable"
    admitted, _, finished, aborted, window_used, quant_used = final_stats(log)
    assert (admitted, finished, window_used, quant_used) == (5, 5, 0, 0)
    assert aborted == sum(kind == "error" for kind, _ in outcomes)


def test_a_second_signal_exits_at_once(model_dir):
    server = ServeProcess(model_dir, "--max-num-seqs", "1", "--shutdown-timeout", "60")
    streams = [server.open_stream() for _ in range(3)]
    results, threads = read_all_in_threads(streams)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    started = time.monotonic()
    server.proc.send_signal(signal.SIGINT)
    code, log = server.finish(timeout=10)
    assert code == 128 + signal.SIGINT and time.monotonic() - started < 5, log[-2000:]
    assert "second SIGINT: exiting now" in log
    for t in threads:
        t.join(10)
    assert any(isinstance(r, Exception) for r in results)  # cut, as asked: the process is gone
