"""The OpenAI-compatible server over loopback, driven by the real ``openai`` client."""

from __future__ import annotations

import http.client
import json
import socket

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from server_http import get, post, running, wait_idle  # noqa: E402

from oscar_compile.runtime.async_engine import AsyncEngine  # noqa: E402
from oscar_compile.runtime.core.sampling_params import SamplingParams  # noqa: E402
from oscar_compile.runtime.engine_config import EngineConfig, build_engine  # noqa: E402
from oscar_compile.runtime.llm import LLM  # noqa: E402
from oscar_compile.runtime.server.app import create_app  # noqa: E402

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_model, tokenizer):
    engine = build_engine(tiny_model, tokenizer, EngineConfig(num_window_pages=0, num_quant_pages=256,
                                                              max_num_batched_tokens=64))
    async_engine = AsyncEngine(engine)
    with running(create_app(async_engine, MODEL)) as port:
        yield port, async_engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{server[0]}/v1", max_retries=0)


def test_completion_matches_offline_generation(client, tiny_model, tokenizer):
    response = client.completions.create(model=MODEL, prompt="hello world", max_tokens=10,
                                         temperature=0, logprobs=2)
    offline = LLM(tiny_model, tokenizer=tokenizer).generate(
        "hello world", SamplingParams(max_tokens=10, temperature=0))[0].outputs[0]
    choice = response.choices[0]
    assert choice.text == offline.text and choice.finish_reason == offline.finish_reason
    assert response.usage.completion_tokens == len(offline.token_ids)
    assert response.usage.prompt_tokens == len(tokenizer.encode("hello world"))
    assert len(choice.logprobs.token_logprobs) == len(offline.token_ids)
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_completion_uses_the_chat_template(client, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                              temperature=0, logprobs=True, top_logprobs=2)
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert response.usage.prompt_tokens == len(prompt_ids)
    message = response.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    assert all(len(entry.top_logprobs) == 2 for entry in response.choices[0].logprobs.content)


def test_streaming_equals_the_whole_response(client):
    kwargs = dict(model=MODEL, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt="The quick brown", **kwargs).choices[0].text
    chunks = list(client.completions.create(prompt="The quick brown", stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": "hello"}]
    whole_chat = client.chat.completions.create(messages=messages, **kwargs).choices[0].message.content
    stream = list(client.chat.completions.create(messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **kwargs))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole_chat
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 16


def test_many_concurrent_clients(client):
    """Mixed lengths, all at once: each completes with what it gives alone (greedy)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> tuple[str, str]:
        choice = client.completions.create(model=MODEL, prompt="hello " * (i % 7 + 1), max_tokens=i % 9 + 1,
                                           temperature=0).choices[0]
        return choice.text, choice.finish_reason

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(one, range(24)))
    assert together == [one(i) for i in range(24)]
    assert all(reason in ("stop", "length") for _, reason in together)


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, 400,
     "stream_options.include_usage"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, "x"]]}, 400, "prompt.0.1"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "messages.0.content.0.text"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 3.5}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 17}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x " * 600}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages.0.role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    # refused as OpenAI / vLLM refuse them (server/protocol.py says where each bound comes from)
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 600}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [str(i) for i in range(65)]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": "s" * 1025}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": list(range(257))}, 400,
     "stop_token_ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "service_tier": "fastest"}, 400, "service_tier"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "metadata": {str(i): "v" for i in range(17)}}, 400,
     "metadata"),
    ("/v1/completions", {"model": MODEL, "prompt": ["x"] * 129, "max_tokens": 1}, 400, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": []}]}, 400,
     "messages.0.content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"},
                                                           {"role": "tool", "content": "42"}]}, 400,
     "messages.1.tool_call_id"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
     400, "messages.0.tool_call_id"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x " * 600}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 10**6}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
])
def test_bad_requests_get_an_openai_error_and_the_server_keeps_serving(server, path, body, status, param):
    port, _ = server
    got_status, payload = post(port, path, body)
    assert got_status == status
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    ok_status, ok = post(port, "/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert ok_status == 200 and ok["choices"][0]["finish_reason"] in ("stop", "length")


def test_sampling_controls_over_http_equal_transformers_generate(server, client, tiny_model, tokenizer):
    """Greedy with a repetition penalty (and every other control sent as null, which means its
    default) gives transformers' generate with its RepetitionPenaltyLogitsProcessor; a logit_bias
    of +100 through the openai client forces its token, while the logprobs stay the model's."""
    import torch

    port = server[0]
    ids = tokenizer.encode("hello world hello world")
    nulls = dict.fromkeys(["presence_penalty", "frequency_penalty", "logit_bias", "min_p", "min_tokens"])
    status, body = post(port, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 12, "temperature": 0,
                                                  "repetition_penalty": 1.8, **nulls})
    assert status == 200, body
    with torch.no_grad():
        reference = tiny_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                        repetition_penalty=1.8)[0, len(ids):].tolist()
    assert body["choices"][0]["text"] == tokenizer.decode(reference, skip_special_tokens=True)
    greedy = SamplingParams(max_tokens=12, temperature=0)
    plain = LLM(tiny_model, tokenizer=tokenizer).generate([ids], greedy)[0].outputs[0]
    assert plain.text != body["choices"][0]["text"]  # the penalty changed the greedy output

    forced = tokenizer.encode(" fox")[0]
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logit_bias={str(forced): 100}, logprobs=True, top_logprobs=1, extra_body={"min_tokens": 4})
    choice = response.choices[0]
    assert choice.message.content == tokenizer.decode([forced] * 4) and choice.finish_reason == "length"
    entries = choice.logprobs.content
    assert all(e.logprob <= e.top_logprobs[0].logprob for e in entries)  # the model's, not the biased ones
    assert any(e.logprob < e.top_logprobs[0].logprob for e in entries)


def test_the_openai_client_raises_on_a_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert info.value.body["param"] == "temperature"


def test_a_client_disconnecting_mid_stream_frees_its_pages(server):
    port, async_engine = server
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 400, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    before = async_engine.stats
    assert before["num_running"] == 1 and before["quant_pages_used"] > 0
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    stats = wait_idle(async_engine)
    assert stats["num_requests_aborted"] == before["num_requests_aborted"] + 1


def test_a_client_giving_up_on_a_whole_response_frees_its_pages(server):
    port, async_engine = server
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=0.3)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 480, "ignore_eos": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    aborted = async_engine.stats["num_requests_aborted"]
    with pytest.raises(TimeoutError):
        conn.getresponse()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert wait_idle(async_engine)["num_requests_aborted"] == aborted + 1


def test_health_and_metrics(server):
    port, _ = server
    assert get(port, "/health") == (200, '{"status":"ok"}')
    status, text = get(port, "/metrics")
    assert status == 200
    for name in ("oscar_requests_waiting", "oscar_requests_running", "oscar_prefix_cache_hit_rate",
                 "oscar_generation_tokens_per_second", 'oscar_kv_pages_used{kind="quant"}',
                 'oscar_kv_pages_free{kind="window"}'):
        assert f"\n{name} " in "\n" + text


class _FailOnToken:
    """Wraps a runner; raises when a sequence's context contains ``token`` (a model crash)."""

    def __init__(self, runner, token: int):
        self.runner, self.token = runner, token
        self.vocab_size = runner.vocab_size

    def run(self, batch):
        if any(self.token in ids for ids in batch.context_token_ids):
            raise RuntimeError("simulated model failure")
        return self.runner.run(batch)


def test_a_model_error_fails_the_request_not_the_server(server, client):
    port, async_engine = server
    engine = async_engine.engine
    original = engine.worker.runner
    engine.worker.runner = _FailOnToken(original, token=7)
    try:
        status, payload = post(port, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3})
        assert status == 500 and payload["error"]["type"] == "internal_error"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "stream": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        events = conn.getresponse().read().decode().split("\n\n")
        assert '"error"' in events[0] and events[-2] == "data: [DONE]"
        wait_idle(async_engine)
    finally:
        engine.worker.runner = original
    assert client.completions.create(model=MODEL, prompt="fine", max_tokens=2).choices[0].text is not None


def test_batched_prompts_come_back_as_indexed_choices(client):
    response = client.completions.create(model=MODEL, prompt=["a", "b b", "c"], max_tokens=3, temperature=0)
    assert [c.index for c in response.choices] == [0, 1, 2]
    streamed = list(client.completions.create(model=MODEL, prompt=["a", "b b"], max_tokens=3, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True}))
    texts = {0: "", 1: ""}
    for chunk in streamed:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts[0] == client.completions.create(model=MODEL, prompt="a", max_tokens=3, temperature=0,
                                                 extra_body={"ignore_eos": True}).choices[0].text


def test_serve_cli_builds_the_app_and_refuses_what_it_cannot_serve(model_dir, capsys):
    from oscar_compile.runtime import serve

    app, name = serve.app_from_args(serve.parse_args(["--model", str(model_dir), "--device", "cpu",
                                                  "--kv-memory", "0.01"]))
    assert name == model_dir.name and app.title == "oscar_compile"
    assert serve.main(["--model", str(model_dir / "missing")]) == 2
    assert serve.main(["--model", str(model_dir), "--spec", "specs/oscar-int2.yaml"]) == 2
    assert "pass rotations=" in capsys.readouterr().err  # oscar rotations need calibration data


def test_default_serve_answers_with_the_bundled_model_in_int2():
    """No --model: the bundled model with its shipped OSCAR INT2 rotations, over HTTP, gives what
    the offline API gives with the same spec and rotations (greedy; the prompt fits one chunk)."""
    from oscar_compile.runtime import serve
    from oscar_compile.runtime.engine_config import resolve_model_dir
    from oscar_compile.spec import CompressionSpec

    args = serve.parse_args(["--device", "cpu", "--kv-memory", "0.05"])
    app, name = serve.app_from_args(args)
    prompt = "def fibonacci(n):"
    with running(app) as port:
        status, body = post(port, "/v1/completions", {"model": name, "prompt": prompt, "max_tokens": 12,
                                                      "temperature": 0, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 12
    spec, rotations = serve.compression_for(args, resolve_model_dir(None))
    assert CompressionSpec.from_yaml(spec).kv_cache.bits == 2 and rotations is not None
    llm = LLM(None, spec, rotations, device="cpu", config=EngineConfig(kv_memory_gb=0.05))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert body["choices"][0]["text"] == llm.generate([prompt], params)[0].outputs[0].text

