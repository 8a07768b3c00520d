"""``n`` on both routes (issue #30, item 4), over loopback, on the tiny model with the INT2 cache.

Choices come by ``index``; they differ, repeat when resent, and choice ``i`` is the request with
``seed + i``; usage counts the prompt once; a stream interleaves the choices; echo and logprobs
come per choice; ``/metrics`` shows the prompt's full pages shared, not copied; a client that
leaves aborts every choice; ``best_of`` is accepted only as null or ``n``; the room for
``max_tokens`` counts the pages of every choice.
"""

from __future__ import annotations

import copy
import http.client
import json

import pytest

pytest.importorskip("uvicorn")
parser = pytest.importorskip("prometheus_client.parser")

from server_http import get, post, running, stream_events, wait_idle  # noqa: E402

from oscar_compile import CompressionSpec, apply, calibrate  # noqa: E402
from oscar_compile.runtime.async_engine import AsyncEngine  # noqa: E402
from oscar_compile.runtime.engine_config import EngineConfig, build_engine  # noqa: E402
from oscar_compile.runtime.server.app import create_app  # noqa: E402
from oscar_compile.runtime.worker.compressed_runner import compressed_layout, runner_factory  # noqa: E402

MODEL = "tiny"
INT2 = CompressionSpec.from_dict(
    {
        "kv_cache": {"bits": 2, "group_size": 16, "sink_tokens": 4, "recent_tokens": 8, "page_size": 4},
        "key": {"rotation": "hadamard"},
        "value": {"rotation": "hadamard"},
    }
)
PROMPT = list(range(40, 63))  # 23 tokens: history 11 (2 full pages + a partial one)


@pytest.fixture(scope="module")
def served(tiny_model, tokenizer):
    model = copy.deepcopy(tiny_model)
    compressed = apply(model, INT2, calibrate(model, INT2))
    layout = compressed_layout(model, INT2)
    # prefix hits stop at the sink: a resent prompt is computed as the first time (a hit past the
    # sink would read its history back quantized: README, "Prefix-cache hits")
    config = EngineConfig(layout=layout, num_window_pages=48, num_quant_pages=120, max_num_seqs=16, prefix_hits="sink")
    engine = build_engine(model, tokenizer, config, make_runner=runner_factory(compressed, layout, config))
    async_engine = AsyncEngine(engine)
    with running(create_app(async_engine, MODEL)) as port:
        yield port, async_engine


def _complete(port, **body):
    status, payload = post(port, "/v1/completions", {"model": MODEL, "prompt": PROMPT} | body)
    assert status == 200, payload
    return payload


def _counter(port, name, **labels) -> float:
    status, text = get(port, "/metrics")
    assert status == 200
    family = next(f for f in parser.text_string_to_metric_families(text) if f.name == name)
    return next(s.value for s in family.samples if all(s.labels.get(k) == v for k, v in labels.items()))


SAMPLED = dict(max_tokens=8, temperature=1.0, ignore_eos=True)


def test_choices_differ_repeat_and_are_the_request_with_seed_plus_i(served):
    port, async_engine = served
    shared = _counter(port, "oscar_forked_pages", kind="quant", how="shared")
    copied = _counter(port, "oscar_forked_pages", kind="quant", how="copied")
    body = _complete(port, n=4, seed=11, logprobs=1, **SAMPLED)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert len({c["text"] for c in choices}) == 4
    assert body["usage"]["prompt_tokens"] == len(PROMPT)  # once, not 4 times
    assert body["usage"]["completion_tokens"] == 4 * 8 == sum(len(c["logprobs"]["tokens"]) for c in choices)
    assert _complete(port, n=4, seed=11, logprobs=1, **SAMPLED)["choices"] == choices
    for i in range(4):
        [alone] = _complete(port, seed=11 + i, **SAMPLED)["choices"]
        assert alone["text"] == choices[i]["text"]
    # the prompt's 2 full history pages were shared with 3 choices (each of the two requests),
    # only its partial page copied
    assert _counter(port, "oscar_forked_pages", kind="quant", how="shared") - shared == 2 * 3 * 2
    assert _counter(port, "oscar_forked_pages", kind="quant", how="copied") - copied == 2 * 3
    wait_idle(async_engine)


def test_chat_streams_every_choice_by_index(served):
    port, _ = served
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "n": 3, "seed": 5, **SAMPLED}
    status, whole = post(port, "/v1/chat/completions", body)
    assert status == 200 and [c["index"] for c in whole["choices"]] == [0, 1, 2]
    status, events = stream_events(
        port, "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts, roles, finish = ["", "", ""], [0, 0, 0], [None] * 3
    for chunk in chunks[:-1]:
        [choice] = chunk["choices"]
        i = choice["index"]
        roles[i] += choice["delta"].get("role") == "assistant"
        texts[i] += choice["delta"].get("content") or ""
        finish[i] = choice["finish_reason"] or finish[i]
    assert roles == [1, 1, 1] and finish == ["length"] * 3
    assert texts == [c["message"]["content"] for c in whole["choices"]]
    tokens = ("prompt_tokens", "completion_tokens", "total_tokens")  # (the resent prompt's sink is a cache hit)
    assert [chunks[-1]["usage"][k] for k in tokens] == [whole["usage"][k] for k in tokens]
    assert whole["usage"]["completion_tokens"] == 3 * 8


def test_echo_and_logprobs_come_with_each_choice(served):
    port, _ = served
    body = _complete(port, n=2, seed=1, echo=True, logprobs=1, max_tokens=2, temperature=1.0, ignore_eos=True)
    prompt_part = [c["logprobs"]["token_logprobs"][: len(PROMPT)] for c in body["choices"]]
    assert prompt_part[0] == prompt_part[1] and prompt_part[0][0] is None and None not in prompt_part[0][1:]
    assert all(len(c["logprobs"]["tokens"]) == len(PROMPT) + 2 for c in body["choices"])
    assert body["usage"]["prompt_tokens"] == len(PROMPT)


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"n": 17}, "n"), ({"n": 0}, "n"), ({"n": 2, "best_of": 3}, "best_of"), ({"n": 2, "best_of": 1}, "best_of")],
)
def test_bad_n_and_best_of_are_refused(served, extra, param):
    status, payload = post(port := served[0], "/v1/completions", {"model": MODEL, "prompt": PROMPT, **extra})
    assert status == 400 and payload["error"]["param"] == param, payload
    assert post(port, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 2, "best_of": 2})[0] == 200


def test_max_tokens_room_counts_the_pages_of_every_choice(served):
    port, _ = served
    # 120 history pages: one choice could reach 492 tokens; four share 2 and split the other 118,
    # 29 each: 31 pages, 136 tokens
    assert _complete(port, max_tokens=140, temperature=0.0)["choices"][0]["finish_reason"] in ("stop", "length")
    status, payload = post(port, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 4, "max_tokens": 140})
    assert status == 400 and payload["error"]["param"] == "max_tokens"
    assert "each of 4 choices" in payload["error"]["message"]


def test_a_client_that_leaves_aborts_every_choice(served):
    port, async_engine = served
    aborted = async_engine.stats["num_requests_aborted"]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = {"model": MODEL, "prompt": PROMPT, "n": 3, "stream": True, "max_tokens": 120, "ignore_eos": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    response.fp.readline()  # the first event: the choices are running
    conn.sock.shutdown(2)
    conn.close()
    stats = wait_idle(async_engine)
    assert stats["num_requests_aborted"] == aborted + 1 and stats["window_pages_used"] == 0


def test_several_prompts_number_their_choices_prompt_by_prompt(served):
    port, _ = served
    other = PROMPT[:9]
    body = _complete(port, prompt=[PROMPT, other], n=2, seed=4, **SAMPLED)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == len(PROMPT) + len(other)
    for p, ids in enumerate((PROMPT, other)):
        for j in range(2):
            [alone] = _complete(port, prompt=ids, seed=4 + j, **SAMPLED)["choices"]
            assert body["choices"][2 * p + j]["text"] == alone["text"]
