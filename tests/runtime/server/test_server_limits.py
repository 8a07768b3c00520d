"""What the server holds for a client: body size, the waiting queue, a deadline, default lengths."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

pytest.importorskip("uvicorn")

from server_http import post, running, stream_events, wait_idle  # noqa: E402

from oscar_compile.runtime.async_engine import AsyncEngine  # noqa: E402
from oscar_compile.runtime.engine_config import EngineConfig, build_engine  # noqa: E402
from oscar_compile.runtime.server.app import create_app  # noqa: E402
from oscar_compile.runtime.server.server_config import ServerConfig  # noqa: E402

MODEL = "tiny"
BODY_LIMIT = 4096


def _serve(tiny_model, tokenizer, config: ServerConfig, **engine_kwargs):
    engine = build_engine(tiny_model, tokenizer, EngineConfig(num_window_pages=0, num_quant_pages=256,
                                                              max_num_batched_tokens=64, **engine_kwargs))
    async_engine = AsyncEngine(engine)
    return running(create_app(async_engine, MODEL, config)), async_engine


@pytest.fixture(scope="module")
def limited(tiny_model, tokenizer):
    """One sequence at a time, two may wait, 4 KiB bodies, chat defaults to 5 tokens."""
    config = ServerConfig(max_body_bytes=BODY_LIMIT, max_waiting_requests=2, default_chat_max_tokens=5)
    serving, async_engine = _serve(tiny_model, tokenizer, config, max_num_seqs=1)
    with serving as port:
        yield port, async_engine


@pytest.fixture(scope="module")
def deadline_server(tiny_model, tokenizer):
    serving, async_engine = _serve(tiny_model, tokenizer, ServerConfig(request_timeout_s=0.5))
    with serving as port:
        yield port, async_engine


def _open_stream(port: int, body: dict) -> http.client.HTTPConnection:
    """Start a streaming request and read its first event; the caller closes the connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    return conn


def _hang_up(conn: http.client.HTTPConnection) -> None:
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_max_tokens_past_the_context_is_refused_with_openai_wording(limited):
    port, _ = limited
    status, body = post(port, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 510})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["message"].startswith(
        "This model's maximum context length is 512 tokens. However, you requested 513 tokens "
        "(3 in the prompt, 510 in the completion)")
    prompt = [5] * 500
    status, body = post(port, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 13})
    assert status == 400 and "(500 in the prompt, 13 in the completion)" in body["error"]["message"]
    status, body = post(port, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 12,
                                                  "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 12  # exactly the room left


def test_chat_without_max_tokens_gets_the_configured_default(limited):
    port, async_engine = limited
    status, body = post(port, "/v1/chat/completions", {"model": MODEL, "ignore_eos": True,
                                                       "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["finish_reason"] == "length"
    wait_idle(async_engine)


@pytest.mark.parametrize("size", [BODY_LIMIT + 1, 200_000])
def test_a_body_over_the_limit_gets_413_and_a_readable_reply(limited, size):
    port, _ = limited
    padding = "x" * size
    status, body = post(port, "/v1/completions", json.dumps({"model": MODEL, "prompt": padding}).encode())
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert str(BODY_LIMIT) in body["error"]["message"]


def test_a_chunked_body_over_the_limit_gets_413(limited):
    port, _ = limited
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    chunks = (b"x" * 1000 for _ in range(10))  # no Content-Length: counted as it arrives
    conn.request("POST", "/v1/completions", body=chunks, encode_chunked=True,
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 413 and json.loads(response.read())["error"]["code"] == "request_too_large"
    conn.close()
    ok = {"model": MODEL, "prompt": "ok", "max_tokens": 2}
    assert post(port, "/v1/completions", ok)[0] == 200  # under the limit: served


def test_a_full_queue_answers_503_with_retry_after(limited):
    port, async_engine = limited
    long = {"model": MODEL, "prompt": "hello", "max_tokens": 400, "ignore_eos": True}
    running_conn = _open_stream(port, long)  # takes the only sequence slot
    waiting = []
    for _ in range(2):  # two more wait behind it: the queue is full
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps(long), headers={"Content-Type": "application/json"})
        waiting.append(conn)
    _wait_for(lambda: async_engine.num_waiting == 2)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(long), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 503 and response.getheader("Retry-After") == "1"
    assert json.loads(response.read())["error"]["code"] == "queue_full"
    conn.close()
    for conn in [running_conn, *waiting]:
        _hang_up(conn)
    stats = wait_idle(async_engine, timeout=20)
    assert stats["quant_pages_used"] == 0 and async_engine.num_waiting == 0
    assert post(port, "/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 2})[0] == 200


def test_a_request_past_its_deadline_is_aborted_and_its_pages_freed(deadline_server):
    port, async_engine = deadline_server
    aborted = async_engine.stats["num_requests_aborted"]
    long = {"model": MODEL, "prompt": "hello", "max_tokens": 480, "ignore_eos": True}
    started = time.monotonic()
    status, body = post(port, "/v1/completions", long)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert time.monotonic() - started < 5
    status, events = stream_events(port, "/v1/completions", {**long, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "request_timeout" and error["type"] == "timeout_error"
    assert all("choices" in json.loads(e) for e in events[:-2])  # tokens streamed until the deadline
    stats = wait_idle(async_engine)
    assert stats["num_requests_aborted"] == aborted + 2
    status, body = post(port, "/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert status == 200  # a short request finishes well within the deadline


def test_a_chat_template_that_refuses_the_messages_is_a_400(tiny_model, tokenizer):
    """Templates raise on what they do not take (here: a system message); that is the client's
    request, not a server error."""
    import copy

    strict = copy.deepcopy(tokenizer)
    strict.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                            "supported') }}{% endif %}" + tokenizer.chat_template)
    engine = build_engine(tiny_model, strict, EngineConfig(num_window_pages=0, num_quant_pages=64))
    with running(create_app(AsyncEngine(engine), MODEL)) as port:
        status, body = post(port, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": "u"}]})
        assert status == 400 and body["error"]["param"] == "messages"
        assert "System role not supported" in body["error"]["message"]
        status, _ = post(port, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "u"}]})
        assert status == 200
