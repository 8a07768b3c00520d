"""Faults while the server is loaded: disconnect storms and forced preemption.

Afterwards nothing is lost: every request that stayed connected completes with what it gives
alone (greedy; the RecomputeRunner recomputes preempted sequences exactly), every page is free,
and the server's admission count is back to zero.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import pytest

pytest.importorskip("uvicorn")

from server_http import post, running, wait_idle  # noqa: E402

from oscar_compile.runtime.async_engine import AsyncEngine  # noqa: E402
from oscar_compile.runtime.core.sampling_params import SamplingParams  # noqa: E402
from oscar_compile.runtime.engine_config import EngineConfig, build_engine  # noqa: E402
from oscar_compile.runtime.llm import LLM  # noqa: E402
from oscar_compile.runtime.server.app import create_app  # noqa: E402

MODEL = "tiny"


def _serve(tiny_model, tokenizer, **engine_kwargs):
    engine = build_engine(tiny_model, tokenizer, EngineConfig(num_window_pages=0, max_num_batched_tokens=64,
                                                              **engine_kwargs))
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine, MODEL)
    return running(app), async_engine, app.state.admission


def _prompt(i: int) -> str:
    return "hello " * (i % 5 + 1) + f"number {i}"


def _offline(tiny_model, tokenizer, prompts, max_tokens) -> list[str]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [out.outputs[0].text for out in LLM(tiny_model, tokenizer=tokenizer).generate(prompts, params)]


def _run_in_threads(fns) -> list:
    results = [None] * len(fns)

    def call(i):
        try:
            results[i] = fns[i]()
        except Exception as err:  # reported by the caller
            results[i] = err
    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def _assert_idle(async_engine, admission) -> dict:
    stats = wait_idle(async_engine, timeout=30)
    deadline = time.monotonic() + 10
    while admission.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert admission.num_in_flight == 0 and async_engine.num_waiting == 0
    assert stats["quant_pages_used"] == 0 and stats["window_pages_used"] == 0
    return stats


class _Client:
    """One client of the storm; ``how`` says when it hangs up (or "stays" to the end)."""

    def __init__(self, port: int, how: str, body: dict, rng: random.Random):
        self.port, self.how, self.body, self.rng = port, how, body, rng

    def __call__(self):
        data = json.dumps(self.body).encode()
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=60)
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        try:
            if self.how == "mid-upload":
                sock.sendall(head + data[: len(data) // 2])
                return None
            if self.how == "at-once":
                return None
            sock.sendall(head + data)
            if self.how == "before-reply":
                time.sleep(self.rng.uniform(0, 0.3))
                return None
            return self._read(sock)
        finally:
            with _suppress():
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _read(self, sock) -> str | None:
        stop_after = self.rng.randint(0, 4) if self.how == "mid-stream" else None
        reader = sock.makefile("rb")
        status = reader.readline()
        assert b" 200 " in status, status
        while reader.readline() not in (b"\r\n", b""):
            pass
        text, events = "", 0
        while True:
            size = int(reader.readline().strip() or b"0", 16)  # chunked transfer
            if size == 0:
                return text
            chunk = reader.read(size)
            reader.readline()
            for event in chunk.decode().split("\n\n"):
                if event.startswith("data: {"):
                    body = json.loads(event[6:])
                    assert "error" not in body, body
                    text += body["choices"][0]["text"] if body.get("choices") else ""
                    events += 1
                elif event.startswith("data: [DONE]"):
                    return text
            if stop_after is not None and events > stop_after:
                return None


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], OSError)


def test_disconnect_storms_free_every_page_and_spare_the_clients_that_stay(tiny_model, tokenizer):
    serving, async_engine, admission = _serve(tiny_model, tokenizer, num_quant_pages=512, max_num_seqs=32)
    rng = random.Random(23)
    stay = list(range(8))
    expected = _offline(tiny_model, tokenizer, [_prompt(i) for i in stay], 24)
    with serving as port:
        for storm in range(3):
            hows = ["stays"] * len(stay) + [rng.choice(["mid-stream", "mid-stream", "before-reply", "mid-upload",
                                                        "at-once"]) for _ in range(40)]
            clients = []
            for i, how in enumerate(hows):
                body = {"model": MODEL, "prompt": _prompt(i), "temperature": 0, "ignore_eos": True,
                        "max_tokens": 24 if how == "stays" else 200, "stream": how in ("stays", "mid-stream")}
                clients.append(_Client(port, how, body, random.Random(rng.random())))
            results = _run_in_threads(clients)
            errors = [r for r in results if isinstance(r, Exception)]
            assert not errors, errors[:3]
            assert results[: len(stay)] == expected, f"storm {storm}"
            stats = _assert_idle(async_engine, admission)
        assert stats["num_requests_aborted"] > 0
        status, body = post(port, "/v1/completions", {"model": MODEL, "prompt": "after", "max_tokens": 3})
        assert status == 200


def _paged_bf16(tokenizer, **engine_kwargs):
    """An engine over a fresh copy of the tiny model in the runtime's BF16 mode (the compressed
    runner over 16-bit pages; on a CPU its reference ops)."""
    from tiny_models import build_model

    from oscar_compile.runtime.llm import compress
    from oscar_compile.spec import shipped_spec

    model = build_model(len(tokenizer))  # the same seed: the same weights as tiny_model
    _, config, make_runner = compress(model, shipped_spec("bf16"), None,
                                   EngineConfig(num_window_pages=0, max_num_batched_tokens=64, **engine_kwargs))
    return build_engine(model, tokenizer, config, make_runner=make_runner)


@pytest.mark.parametrize("runner", ["recompute", "paged-bf16"])
def test_a_page_budget_that_forces_preemption_loses_nothing_with_32_running(tiny_model, tokenizer, runner):
    """32 requests of ~60 tokens need ~128 pages of 16 tokens; 24 pages force preemption again and
    again. Each still completes with exactly the tokens it gives alone: the recompute runner
    recomputes exactly, and the BF16 mode's output does not depend on chunking."""
    prompts = [_prompt(i) for i in range(32)]
    expected = _offline(tiny_model, tokenizer, prompts, 48)
    if runner == "recompute":
        serving, async_engine, admission = _serve(tiny_model, tokenizer, num_quant_pages=24, max_num_seqs=32)
    else:
        async_engine = AsyncEngine(_paged_bf16(tokenizer, num_quant_pages=24, max_num_seqs=32))
        app = create_app(async_engine, MODEL)
        serving, admission = running(app), app.state.admission
    with serving as port:
        before = async_engine.stats["num_preemptions"]

        def one(i):
            body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 48, "temperature": 0, "ignore_eos": True}
            return post(port, "/v1/completions", body)
        results = _run_in_threads([lambda i=i: one(i) for i in range(32)])
        errors = [r for r in results if isinstance(r, Exception)]
        assert not errors, errors[:3]
        assert [status for status, _ in results] == [200] * 32
        assert [body["choices"][0]["text"] for _, body in results] == expected
        assert all(body["usage"]["completion_tokens"] == 48 for _, body in results)
        stats = _assert_idle(async_engine, admission)
        assert stats["num_preemptions"] - before >= 8
        assert stats["num_requests_aborted"] == 0
