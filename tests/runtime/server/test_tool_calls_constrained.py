"""``tool_choice: "required"`` and a named function, grammar-constrained end to end on the bundled
19M model (issue #30, item 3 and its CPU tests): the calls validate against the tool's
parameters, streamed and not, and LangChain reads them.

The constraint is the structured-output backend's (``runtime/structured_output/``); without it
these tests are skipped (the server's side is tested without a model in test_tool_parsers.py and
test_server_tool_calls.py). The schemas bound every field (enums, integer ranges) and
``parallel_tool_calls: false`` bounds the array, so that the tiny model cannot write past
``max_tokens`` inside a valid prefix (a few seconds a request on a busy CPU).
"""

from __future__ import annotations

import http.client
import json

import pytest

pytest.importorskip("uvicorn")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("oscar_compile.runtime.structured_output", reason="needs the structured-output backend")

from server_http import running, stream_events  # noqa: E402

from oscar_compile.assembly import assemble  # noqa: E402
from oscar_compile.loading import BUNDLED_MODEL_DIR  # noqa: E402
from oscar_compile.runtime.async_engine import AsyncEngine  # noqa: E402
from oscar_compile.runtime.engine_config import EngineConfig  # noqa: E402
from oscar_compile.runtime.server.app import create_app  # noqa: E402
from oscar_compile.runtime.server.server_config import ServerConfig  # noqa: E402
from oscar_compile.spec import specs_dir  # noqa: E402

MODEL = "oscar-tiny"
pytestmark = pytest.mark.usefixtures("one_torch_thread")
MAX_TOKENS = 64  # a call of these tools is about 30 tokens

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather forecast for a city",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "days"],
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "description": "Set an alarm",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["hour", "loud"],
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "loud": {"type": "boolean"}},
        },
    },
}
TOOLS = [WEATHER, ALARM]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def port():
    """The bundled model as ``serve`` serves it (oscar-int2 and its shipped rotations), with
    prompt-exact prefill: decode-consistent (the default) runs a reference prefill on the CPU, a
    cost these tool-call tests do not need (its semantics are test_decode_consistent_prefill.py's)."""
    config = EngineConfig(kv_memory_gb=0.05, max_num_seqs=4, max_num_batched_tokens=256,
                          prefill_semantics="prompt-exact")
    built = assemble(
        BUNDLED_MODEL_DIR,
        str(specs_dir() / "oscar-int2.yaml"),
        str(BUNDLED_MODEL_DIR / "rotations" / "oscar-int2.safetensors"),
        device="cpu",
        config=config,
    )
    with running(create_app(AsyncEngine(built.engine), MODEL, ServerConfig())) as port:
        yield port


def post(port: int, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def check_calls(calls: list[dict], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"] and call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[call["function"]["name"]])


def streamed_calls(port: int, body: dict) -> tuple[list[dict], str, str]:
    """(the calls rebuilt from the deltas, the streamed content, the last finish_reason)."""
    status, events = stream_events(port, "/v1/chat/completions", {**body, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in (json.loads(e) for e in events[:-1]):
        choice = chunk["choices"][0]
        content += choice["delta"].get("content") or ""
        finish = choice["finish_reason"] or finish
        for entry in choice["delta"].get("tool_calls", []):
            if entry["index"] not in calls:
                calls[entry["index"]] = {
                    "id": entry["id"],
                    "type": entry["type"],
                    "function": {"name": entry["function"]["name"], "arguments": ""},
                }
            calls[entry["index"]]["function"]["arguments"] += entry["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)], content, finish


# (tool_choice, the names a call may have, finish_reason: OpenAI's and vLLM's "stop" for a named one)
CHOICES = [
    ("required", {"get_weather", "set_alarm"}, "tool_calls"),
    ({"type": "function", "function": {"name": "set_alarm"}}, {"set_alarm"}, "stop"),
]


@pytest.mark.parametrize("choice, names, finish_reason", CHOICES, ids=["required", "named"])
def test_forced_calls_validate_against_the_tool_parameters(port, choice, names, finish_reason):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": choice,
        "parallel_tool_calls": False,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    status, reply = post(port, body)
    assert status == 200, reply
    message, finish = reply["choices"][0]["message"], reply["choices"][0]["finish_reason"]
    assert finish == finish_reason and message["content"] is None
    check_calls(message["tool_calls"], names)
    calls, content, finish = streamed_calls(port, body)
    assert finish == finish_reason and content == ""
    check_calls(calls, names)
    assert [c["function"] for c in calls] == [c["function"] for c in message["tool_calls"]]  # greedy: the same


def test_required_with_parallel_calls_sampled(port):
    """Parallel calls allowed, sampled: the array may run past ``max_tokens`` (then no calls and
    ``length``); whatever calls come back validate."""
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 2 * MAX_TOKENS,
        "temperature": 0.8,
        "seed": 3,
    }
    status, reply = post(port, body)
    assert status == 200
    choice = reply["choices"][0]
    if choice["finish_reason"] == "length":
        assert "tool_calls" not in choice["message"] and choice["message"]["content"].lstrip().startswith("[")
    else:
        assert choice["finish_reason"] == "tool_calls"
        check_calls(choice["message"]["tool_calls"], set(PARAMETERS))


def test_langchain_reads_a_forced_call_of_the_bundled_model(port):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key="x",
        max_retries=0,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    for tool_choice, names in (("get_weather", {"get_weather"}), ("any", set(PARAMETERS))):
        bound = llm.bind_tools(TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
        answer = bound.invoke(MESSAGES[0]["content"])
        assert answer.tool_calls and answer.invalid_tool_calls == []
        for call in answer.tool_calls:
            assert call["name"] in names
            jsonschema.validate(call["args"], PARAMETERS[call["name"]])
        merged = None
        for piece in bound.stream(MESSAGES[0]["content"]):
            merged = piece if merged is None else merged + piece
        assert [(c["name"], c["args"]) for c in merged.tool_calls] == [
            (c["name"], c["args"]) for c in answer.tool_calls
        ]
