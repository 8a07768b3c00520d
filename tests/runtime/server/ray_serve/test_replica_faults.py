"""A replica killed during a load run: every request is answered, Ray brings the replica back,
and no page is left in use.

What each request may get: a 200 (it ran on the survivor, or was sent again because its replica
died before answering); a stream that ends with an OpenAI error event and ``[DONE]`` (its replica
died mid-stream); or, for a request that is not streamed and whose replica died while it was
generating, a 503 error body (RemoteEngine does not resend a request once outputs have come back).
Never a hang: every call has a client timeout, and the session a watchdog (conftest.py).
"""

from __future__ import annotations

import threading
import time

import pytest
from conftest import AFFINITY_APP
from replica_http import get, metric_values, post

pytest.importorskip("ray.serve")

_APP = AFFINITY_APP
_NUM_REQUESTS = 12


def _engine_replicas() -> list[str]:
    from ray.util import list_named_actors

    return [a["name"] for a in list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{_APP}#engine#")]


def _num_running(deployment: str = "engine") -> int:
    from ray import serve

    states = serve.status().applications[_APP].deployments[deployment].replica_states
    return states.get("RUNNING", 0)


def _send(port: int, prefix: int, i: int, results: dict) -> None:
    body = {"prompt": [100 + i] * 40, "max_tokens": 160, "temperature": 0, "ignore_eos": True,
            "stream": i % 2 == 0}
    try:
        results[i] = post(port, prefix + "/v1/completions", body, timeout=120)
    except Exception as err:  # a hang or a dropped connection fails below
        results[i] = (None, repr(err))


def _answered(status, body, stream: bool) -> str:
    """How a request ended: "ok", "stream-error", "503" — or raise."""
    if not stream:
        if status == 200:
            assert body["choices"][0]["finish_reason"] == "length", body
            return "ok"
        assert status == 503 and body["error"]["type"] == "service_unavailable", (status, body)
        return "503"
    assert status == 200 and body[-1] == "[DONE]", (status, body)
    errors = [e for e in body[:-1] if "error" in e]
    if errors:
        assert len(errors) == 1 and body[-2] is errors[0], body  # the error event ends the stream
        assert errors[0]["error"]["type"] == "service_unavailable", errors
        return "stream-error"
    assert body[-2]["choices"][0]["finish_reason"] == "length", body[-3:]
    return "ok"


def test_a_replica_killed_mid_load(affinity_app):
    import ray

    port, prefix = affinity_app
    assert len(_engine_replicas()) == 2
    results: dict[int, tuple] = {}
    threads = [threading.Thread(target=_send, args=(port, prefix, i, results)) for i in range(_NUM_REQUESTS)]
    for t in threads[:8]:
        t.start()
    deadline = time.monotonic() + 30
    while True:  # until both replicas are streaming tokens out
        generated = metric_values(get(port, prefix + "/metrics")[1], "oscar_generation_tokens_total")
        if len(generated) == 2 and all(v >= 16 for v in generated.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    victim = _engine_replicas()[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    for t in threads[8:]:  # sent while the router may still list the dead replica
        t.start()
    for t in threads:
        t.join(150)
    assert not any(t.is_alive() for t in threads), "a request hung"
    outcomes = [_answered(*results[i], stream=i % 2 == 0) for i in range(_NUM_REQUESTS)]
    assert "stream-error" in outcomes or "503" in outcomes, outcomes  # the kill hit requests under way
    assert outcomes.count("ok") >= _NUM_REQUESTS - 8, outcomes  # the survivor and the resent ones served
    resent = metric_values(get(port, prefix + "/metrics")[1], "oscar_ingress_resent_requests_total")
    assert list(resent) == [""]  # requests sent again after their replica died before answering: counted

    deadline = time.monotonic() + 120
    while (_num_running() < 2 or victim in _engine_replicas()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _num_running() == 2 and victim not in _engine_replicas()  # Ray replaced it
    for i in range(4):  # both replicas serve again (p2c spreads these)
        status, body = post(port, prefix + "/v1/completions", {"prompt": [7 + i] * 20, "max_tokens": 4})
        assert status == 200, body
    deadline = time.monotonic() + 30
    while True:
        text = get(port, prefix + "/metrics")[1]
        used = metric_values(text, "oscar_kv_pages_used")
        if len(used) == 6 and all(v == 0 for v in used.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(used) == 6 and all(v == 0 for v in used.values()), used  # 2 replicas x 3 page kinds, none held
