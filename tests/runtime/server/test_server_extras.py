"""vLLM's operational extras and the lenient body rules (issue #30, items 6 and 7): the tokenizer
routes, /v1/models/{id}, /version, several served names, --chat-template and
chat_template_kwargs, explicit nulls, unknown fields (ignored and counted, or refused with
--strict-fields), long stop lists, and which routes the API key guards."""

from __future__ import annotations

import http.client
import json
import logging

import pytest
from jinja2 import Template

pytest.importorskip("uvicorn")

from server_http import running  # noqa: E402

import oscar_compile  # noqa: E402
from oscar_compile.runtime import serve  # noqa: E402
from oscar_compile.runtime.async_engine import AsyncEngine  # noqa: E402
from oscar_compile.runtime.engine_config import EngineConfig, build_engine  # noqa: E402
from oscar_compile.runtime.server import parsing  # noqa: E402
from oscar_compile.runtime.server.app import create_app  # noqa: E402
from oscar_compile.runtime.server.server_config import ServerConfig  # noqa: E402

NAMES = ["tiny", "tiny-alias"]
KEY = "sk-extras-0123456789"
# a template with a request variable: chat_template_kwargs {"shout": true} upper-cases the turns
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{{ m['content'] | upper if shout else m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "user", "content": "hello world"}]


def _serve(tiny_model, tokenizer, config: ServerConfig):
    engine = build_engine(tiny_model, tokenizer, EngineConfig(num_window_pages=0, num_quant_pages=128,
                                                              max_num_batched_tokens=64))
    return running(create_app(AsyncEngine(engine), NAMES, config)), engine


@pytest.fixture(scope="module")
def extras(tiny_model, tokenizer):
    """Two served names, the API key, the test template: (port, engine)."""
    serving, engine = _serve(tiny_model, tokenizer, ServerConfig(api_key=KEY, chat_template=TEMPLATE))
    with serving as port:
        yield port, engine


@pytest.fixture(scope="module")
def strict(tiny_model, tokenizer):
    serving, _ = _serve(tiny_model, tokenizer, ServerConfig(strict_fields=True))
    with serving as port:
        yield port


def call(port: int, method: str, path: str, body: dict | None = None, key: str | None = KEY):
    """(status, parsed JSON or text) of one request, with the API key unless ``key`` is None."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
    response = conn.getresponse()
    raw = response.read().decode()
    conn.close()
    try:
        return response.status, json.loads(raw)
    except ValueError:
        return response.status, raw


def _rendered(messages, add_generation_prompt=True, **variables) -> str:
    return Template(TEMPLATE).render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)


# --- the tokenizer routes -----------------------------------------------------------------------

def test_tokenize_a_prompt_as_the_tokenizer_does(extras, tokenizer):
    port, engine = extras
    status, body = call(port, "POST", "/tokenize", {"model": "tiny", "prompt": "hello world, héllo"})
    ids = tokenizer.encode("hello world, héllo")
    assert status == 200
    assert body == {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": None}
    status, body = call(port, "POST", "/tokenize", {"prompt": "hello", "add_special_tokens": False,
                                                     "return_token_strs": True})
    assert status == 200 and body["token_strs"] == tokenizer.convert_ids_to_tokens(tokenizer.encode("hello"))


def test_tokenize_messages_through_the_configured_template_as_chat_does(extras, tokenizer):
    port, _ = extras
    for kwargs, extra in (({}, {}), ({"shout": True}, {"chat_template_kwargs": {"shout": True}})):
        status, body = call(port, "POST", "/tokenize", {"messages": MESSAGES, **extra})
        expected = tokenizer.encode(_rendered(MESSAGES, **kwargs), add_special_tokens=False)
        assert status == 200 and body["tokens"] == expected and body["count"] == len(expected)
        # the chat route renders the very same ids
        status, chat = call(port, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, **extra})
        assert status == 200 and chat["usage"]["prompt_tokens"] == len(expected)
    status, body = call(port, "POST", "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert body["tokens"] == tokenizer.encode(_rendered(MESSAGES, add_generation_prompt=False),
                                              add_special_tokens=False)


def test_detokenize_round_trips_and_names_a_bad_id(extras, tokenizer):
    port, _ = extras
    ids = tokenizer.encode("hello world, 你好")
    status, body = call(port, "POST", "/detokenize", {"model": "tiny-alias", "tokens": ids})
    assert (status, body) == (200, {"prompt": "hello world, 你好"})
    status, body = call(port, "POST", "/detokenize", {"tokens": [ids[0], 10**6]})
    assert status == 400 and body["error"]["param"] == "tokens.1"


def test_tokenizer_info_names_the_special_tokens_and_the_template(extras, tokenizer):
    port, _ = extras
    status, info = call(port, "GET", "/tokenizer_info", key=None)
    assert status == 200
    assert info["eos_token"] == "<|endoftext|>" == tokenizer.eos_token and info["pad_token"] == "<|endoftext|>"
    assert info["bos_token"] is None and info["tokenizer_class"] == type(tokenizer).__name__
    assert info["chat_template"] == TEMPLATE  # the one the server renders with, not the tokenizer's


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": "x", "messages": MESSAGES}, "messages"),
    ({"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ({"messages": MESSAGES, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs.tokenize"),
    ({"prompt": 5}, "prompt"),
])
def test_bad_tokenize_bodies_name_the_field(extras, body, param):
    status, reply = call(extras[0], "POST", "/tokenize", body)
    assert status == 400 and reply["error"]["param"] == param


# --- models, version, names, the API key --------------------------------------------------------

def test_models_list_every_name_and_answer_one_by_id(extras):
    port, engine = extras
    status, listed = call(port, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in listed["data"]] == NAMES
    assert all(m["root"] == "tiny" and m["max_model_len"] == engine.max_model_len for m in listed["data"])
    status, card = call(port, "GET", "/v1/models/tiny-alias")
    assert status == 200 and card == listed["data"][1]
    for unknown in ("gpt-4", "org/model"):
        status, body = call(port, "GET", f"/v1/models/{unknown}")
        assert status == 404
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == "model"
        assert body["error"]["code"] == "model_not_found" and repr(unknown) in body["error"]["message"]


def test_a_request_may_name_any_served_name_and_the_first_is_reported(extras):
    port, _ = extras
    status, body = call(port, "POST", "/v1/completions", {"model": "tiny-alias", "prompt": "hi", "max_tokens": 2})
    assert status == 200 and body["model"] == "tiny"
    status, body = call(port, "POST", "/v1/chat/completions", {"model": "other", "messages": MESSAGES})
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"


def test_the_api_key_guards_v1_only_as_vllm(extras):
    port, _ = extras
    assert call(port, "GET", "/version", key=None) == (200, {"version": oscar_compile.__version__})
    assert call(port, "POST", "/tokenize", {"prompt": "hi"}, key=None)[0] == 200
    assert call(port, "POST", "/detokenize", {"tokens": [1]}, key=None)[0] == 200
    assert call(port, "GET", "/tokenizer_info", key=None)[0] == 200
    status, body = call(port, "GET", "/v1/models/tiny", key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


# --- nulls, unknown fields, stops ---------------------------------------------------------------

COMPLETION_NULLS = ["n", "stream", "stream_options", "echo", "logprobs", "stop", "seed", "top_p",
                    "presence_penalty", "frequency_penalty", "user", "logit_bias", "best_of", "suffix", "top_k",
                    "ignore_eos", "stop_token_ids", "metadata", "store", "service_tier", "skip_special_tokens"]
CHAT_NULLS = ["n", "stream", "stream_options", "stop", "seed", "top_p", "presence_penalty", "frequency_penalty",
              "user", "logit_bias", "logprobs", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
              "parallel_tool_calls", "response_format", "chat_template_kwargs"]


def test_an_explicit_null_means_the_default(extras):
    port, _ = extras
    plain = {"prompt": "The quick brown", "max_tokens": 6, "temperature": 0}
    status, want = call(port, "POST", "/v1/completions", plain)
    status, got = call(port, "POST", "/v1/completions", {**plain, **dict.fromkeys(COMPLETION_NULLS)})
    assert status == 200 and got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["choices"][0]["logprobs"] is None and len(got["choices"]) == 1
    status, got = call(port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": None, "temperature": None})
    assert status == 200 and got["usage"]["completion_tokens"] <= 16  # the legacy default
    chat = {"messages": [{"role": "user", "content": "hi", "name": None}], "max_tokens": 4, "temperature": 0}
    status, want = call(port, "POST", "/v1/chat/completions", chat)
    status, got = call(port, "POST", "/v1/chat/completions", {**chat, **dict.fromkeys(CHAT_NULLS)})
    assert status == 200 and got["choices"][0]["message"] == want["choices"][0]["message"]
    status, body = call(port, "POST", "/v1/completions", {"prompt": None})  # required: null is not a prompt
    assert status == 400 and body["error"]["param"] == "prompt"


def _ignored(port: int, field: str) -> int:
    _, text = call(port, "GET", "/metrics")
    for line in text.splitlines():
        if line.startswith(f'oscar_ignored_request_fields_total{{field="{field}"}} '):
            return int(float(line.split()[-1]))
    return 0


def test_unknown_fields_are_ignored_logged_once_and_counted(extras, caplog):
    port, _ = extras
    body = {"prompt": "The quick brown", "max_tokens": 4, "temperature": 0}
    _, want = call(port, "POST", "/v1/completions", body)
    with caplog.at_level(logging.WARNING, logger=parsing.__name__):
        for _ in range(2):  # lm-eval spreads its generation kwargs into the body
            status, got = call(port, "POST", "/v1/completions", {**body, "do_sample": False, "until": ["\n"]})
            assert status == 200 and got["choices"][0]["text"] == want["choices"][0]["text"]
        chat = {"messages": [{**MESSAGES[0], "weight": 1}], "max_tokens": 1, "stream_options": None,
                "extra_thing": {"a": 1}}
        assert call(port, "POST", "/v1/chat/completions", chat)[0] == 200
    assert (_ignored(port, "do_sample"), _ignored(port, "until")) == (2, 2)
    assert (_ignored(port, "messages.*.weight"), _ignored(port, "extra_thing")) == (1, 1)
    warned = [r.getMessage() for r in caplog.records if "do_sample" in r.getMessage()]
    assert len(warned) == 1


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "do_sample": False}, "do_sample"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "weight": 1}]}, "messages.0.weight"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "more": 1}},
     "stream_options.more"),
    ("/tokenize", {"prompt": "x", "truncate": True}, "truncate"),
])
def test_strict_fields_refuse_unknown_fields_naming_their_path(strict, path, body, param):
    status, reply = call(strict, "POST", path, body, key=None)
    assert status == 400 and reply["error"]["param"] == param and reply["error"]["code"] == "extra_forbidden"


def test_long_stop_lists_are_served_up_to_the_bound(extras):
    port, _ = extras
    body = {"prompt": "The quick brown", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    _, free = call(port, "POST", "/v1/completions", body)
    text = free["choices"][0]["text"]
    stop = text[4:6]  # lm-eval's code tasks send six stop strings; this one occurs in the output
    stops = ["\nclass", "\ndef", "\n#", "\nif", "\nprint", stop]
    status, got = call(port, "POST", "/v1/completions", {**body, "stop": stops})
    assert status == 200 and got["choices"][0]["text"] == text[:text.index(stop)]
    assert got["choices"][0]["finish_reason"] == "stop"
    filler = [f"@@{i}@@" for i in range(63)] + [stop]
    status, got = call(port, "POST", "/v1/completions", {**body, "stop": filler})
    assert status == 200 and got["choices"][0]["text"] == text[:text.index(stop)]


# --- units: the param path, the label bound, the flags ------------------------------------------

@pytest.mark.parametrize("loc, param", [
    (("stream",), "stream"), (("stream_options", "include_usage"), "stream_options.include_usage"),
    (("string_field",), "string_field"), (("prompt", "list[int]", 0), "prompt.0"),
    (("messages", 0, "content", "list[TextPart]", 0, "text"), "messages.0.content.0.text"),
    (("structured_outputs", "regex"), "structured_outputs.regex"), ((), None),
])
def test_error_param_keeps_field_paths_and_drops_union_tags(loc, param):
    assert parsing.error_param(loc) == param


def test_ignored_field_labels_are_bounded():
    ignored = parsing.IgnoredFields()
    ignored.record(["x" * 10_000, "messages.3.w", "messages.12.w"])
    assert ignored.counts() == {parsing.OTHER_FIELDS_LABEL: 1, "messages.*.w": 2}  # long names: one label
    ignored.record([f"f{i}" for i in range(parsing.MAX_IGNORED_FIELD_LABELS + 6)] + ["f0"])
    counts = ignored.counts()
    # 62 more names fit beside the two labels above; the last 8 join "(other)"
    assert len(counts) == parsing.MAX_IGNORED_FIELD_LABELS and counts[parsing.OTHER_FIELDS_LABEL] == 1 + 8
    assert counts["f0"] == 2


def test_serve_flags_for_names_strict_fields_and_the_template(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    args = serve.parse_args(["--served-model-name", "a", "b", "--strict-fields", "--chat-template", str(template)])
    config = serve.server_config(args)
    assert args.served_model_name == ["a", "b"] and config.strict_fields and config.chat_template == TEMPLATE
    defaults = serve.server_config(serve.parse_args([]))
    assert not defaults.strict_fields and defaults.chat_template is None
    with pytest.raises(FileNotFoundError, match="--chat-template"):
        serve.server_config(serve.parse_args(["--chat-template", str(tmp_path / "missing.jinja")]))


def test_a_one_gpu_server_takes_expandable_segments_unless_told_otherwise():
    """The allocator's cache of split blocks held 5.9 GiB past the planned share on an H100;
    expandable segments 1.4 (calls c and d of bench/results/2026-12-07-gpu-int2-prefill-step)."""
    from oscar_compile.cli.serve import default_allocator_settings

    env = {}
    default_allocator_settings(serve.parse_args([]), env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    env = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}  # the user's own settings stay
    default_allocator_settings(serve.parse_args([]), env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    for flags in (["--tensor-parallel-size", "2"], ["--device", "cpu"]):
        env = {}
        default_allocator_settings(serve.parse_args(flags), env)
        assert env == {}
    from oscar_compile.runtime.core import config as core_config

    default = core_config.GPU_MEMORY_UTILIZATION  # 0.9 (test_the_default_share_is_vllms); None in a GPU session
    assert serve.engine_config(serve.parse_args([])).cache.gpu_memory_utilization == default
    given = serve.engine_config(serve.parse_args(["--gpu-memory-utilization", "0.8"]))
    assert given.cache.gpu_memory_utilization == 0.8
