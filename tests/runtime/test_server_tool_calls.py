"""Tool calls through the HTTP server (issue #30, item 3), with the clients that send them.

The bodies the ``openai`` client and LangChain's ``ChatOpenAI.bind_tools`` send were captured from
the real clients (fixtures/capture_tool_clients.py). A random tiny model does not write tool
calls, so the server here answers from a script: ``ScriptedEngine`` hands back fixed text as if
the model had written it, through the real app (template, parser, response and stream). What the
constrained decode makes of ``required`` and named choices on the bundled model is
test_tool_calls_constrained.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")

from server_http import post, running, stream_events  # noqa: E402

from oscar_compile.loading import BUNDLED_MODEL_DIR  # noqa: E402
from oscar_compile.runtime import serve  # noqa: E402
from oscar_compile.runtime.async_engine import AsyncEngine  # noqa: E402
from oscar_compile.runtime.engine import RequestOutput  # noqa: E402
from oscar_compile.runtime.engine_config import EngineConfig, build_engine  # noqa: E402
from oscar_compile.runtime.server.app import create_app  # noqa: E402
from oscar_compile.runtime.server.server_config import ServerConfig  # noqa: E402
from oscar_compile.runtime.server.tool_calls import AUTO_NEEDS_FLAGS  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
OPENAI_BODIES = json.loads((FIXTURES / "tool_calls_openai.json").read_text())
LANGCHAIN_BODIES = json.loads((FIXTURES / "tool_calls_langchain.json").read_text())
CAPTURED = [
    (f"{client}:{name}", body)
    for client, bodies in (("openai", OPENAI_BODIES), ("langchain", LANGCHAIN_BODIES))
    for name, body in bodies.items()
    if name != "_versions"
]
# the bundled model's template: tools in a <tools> block, calls as <tool_call>, results as <tool_response>
TEMPLATE = json.loads((BUNDLED_MODEL_DIR / "tokenizer_config.json").read_text())["chat_template"]
MODEL = "tiny"
WEATHER = OPENAI_BODIES["auto"]["tools"][0]
HERMES_CALL = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class ScriptedEngine(AsyncEngine):
    """Answers every request with the pieces of ``script``, one output each, whatever the prompt
    (and records each request's prompt and SamplingParams)."""

    def __init__(self, engine):
        super().__init__(engine)
        self.script: list[str] = ["hello"]
        self.requests: list[tuple[list[int], object]] = []

    def submit(self, request, sink, tag=None):
        prompt_token_ids, request_id = request.prompt_token_ids, request.request_id
        self.requests.append((prompt_token_ids, request.params))
        for i, piece in enumerate(self.script):
            last = i == len(self.script) - 1
            sink.put_nowait(
                (
                    tag,
                    RequestOutput(
                        request_id,
                        [1],
                        piece,
                        [],
                        last,
                        "stop" if last else None,
                        len(prompt_token_ids),
                        i + 1,
                        0,
                        request_finished=last,
                    ),
                )
            )


@pytest.fixture(scope="module")
def long_model(tokenizer):
    """The tiny model's shape with room for a prompt that holds tool schemas in 400-token BPE."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
    )
    return Qwen3ForCausalLM(config).eval()


def scripted_server(model, tokenizer, **tool_flags):
    engine = build_engine(
        model, tokenizer, EngineConfig(num_window_pages=0, num_quant_pages=512, max_num_batched_tokens=64)
    )
    scripted = ScriptedEngine(engine)
    config = ServerConfig(chat_template=TEMPLATE, default_chat_max_tokens=8, **tool_flags)
    return running(create_app(scripted, MODEL, config)), scripted


@pytest.fixture(scope="module")
def served(long_model, tokenizer):
    """(port, scripted engine) of a server run as ``--enable-auto-tool-choice --tool-call-parser hermes``."""
    serving, scripted = scripted_server(long_model, tokenizer, tool_call_parser="hermes", enable_auto_tool_choice=True)
    with serving as port:
        yield port, scripted


def test_the_tool_call_flags_reach_the_server_config_and_are_checked_at_start():
    config = serve.server_config(serve.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]))
    assert config.enable_auto_tool_choice and config.tool_call_parser == "hermes"
    defaults = serve.server_config(serve.parse_args([]))
    assert not defaults.enable_auto_tool_choice and defaults.tool_call_parser is None
    with pytest.raises(ValueError, match="tool_call_parser"):
        serve.server_config(serve.parse_args(["--enable-auto-tool-choice"]))
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        serve.parse_args(["--tool-call-parser", "nope"])
    with pytest.raises(ValueError, match="hermes"):
        ServerConfig(tool_call_parser="nope")


@pytest.mark.parametrize("name, body", CAPTURED, ids=[name for name, _ in CAPTURED])
def test_the_captured_client_bodies_are_served(served, tokenizer, name, body):
    port, scripted = served
    forced = body.get("tool_choice") not in (None, "auto")
    scripted.script = (
        ['{"city": "Paris"}']
        if isinstance(body.get("tool_choice"), dict)
        else (['[{"name": "get_weather", "parameters": {"city": "Paris"}}]'] if forced else [HERMES_CALL])
    )
    body = {**body, "model": MODEL}
    if body.get("stream"):
        status, events = stream_events(port, "/v1/chat/completions", body)
        assert status == 200 and events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "error" not in chunks[-1]
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    else:
        status, reply = post(port, "/v1/chat/completions", body)
        assert status == 200, reply
        message = reply["choices"][0]["message"]
        assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        finish = [reply["choices"][0]["finish_reason"]]
    assert finish[-1] == ("stop" if isinstance(body.get("tool_choice"), dict) else "tool_calls")
    prompt, params = scripted.requests[-1]
    rendered = tokenizer.decode(prompt)
    assert "<tools>" in rendered and '"name": "get_weather"' in rendered  # the schema is in the prompt
    if any(m["role"] == "tool" for m in body["messages"]):  # the history's call and its result render
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rendered
        assert "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered
    assert (params.structured_output is not None) == forced
    if forced:
        assert params.structured_output.param == "tool_choice"


def test_langchain_reads_the_tool_calls_of_our_responses(served):
    """``bind_tools`` (tool_choice auto: the hermes parser reads the output), invoked and streamed,
    then the second turn with the ToolMessage."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, unit: str = "celsius") -> str:
        """Get the current weather in a city."""
        return "sunny"

    port, scripted = served
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    bound = llm.bind_tools([get_weather])
    question = [HumanMessage("What is the weather in Paris?")]
    scripted.script = [HERMES_CALL[i : i + 5] for i in range(0, len(HERMES_CALL), 5)]
    answer = bound.invoke(question)
    assert answer.content == "Checking."
    assert [(c["name"], c["args"]) for c in answer.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert answer.response_metadata["finish_reason"] == "tool_calls"
    chunks = list(bound.stream(question))
    merged = chunks[0]
    for piece in chunks[1:]:
        merged += piece
    assert merged.content == "Checking."
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert merged.tool_calls[0]["id"].startswith("chatcmpl-tool-")
    scripted.script = ["It is sunny."]
    final = bound.invoke([*question, answer, ToolMessage("sunny, 21 C", tool_call_id=answer.tool_calls[0]["id"])])
    assert final.content == "It is sunny." and final.tool_calls == []


def test_the_openai_client_reads_streamed_tool_calls(served):
    openai = pytest.importorskip("openai")
    port, scripted = served
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    scripted.script = list(HERMES_CALL)  # one character an output
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER]}
    whole = client.chat.completions.create(**kwargs).choices[0]
    streamed = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    calls = {}
    for choice in streamed:
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
            call["arguments"] += delta.function.arguments or ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert "".join(c.delta.content or "" for c in streamed) == whole.message.content == "Checking."
    assert streamed[-1].finish_reason == whole.finish_reason == "tool_calls"


def test_a_plain_answer_under_auto_has_no_tool_calls(served):
    port, scripted = served
    scripted.script = ["no ", "tools <tool", " needed"]
    status, reply = post(
        port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    )
    assert status == 200
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "no tools <tool needed"}
    assert reply["choices"][0]["finish_reason"] == "stop"


USER = [{"role": "user", "content": "hi"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
        ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools.0.function.parameters"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function"),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0.tool_calls"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages.0.content"),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}
                ]
            },
            "messages.0.tool_calls.0.function.arguments",
        ),
    ],
)
def test_bad_tool_fields_get_a_400_naming_the_field(served, body, param):
    port, _ = served
    status, reply = post(port, "/v1/chat/completions", {"messages": USER, **body})
    assert status == 400 and reply["error"]["param"] == param, reply


def test_auto_needs_the_flags_as_in_vllm(long_model, tokenizer):
    """Without ``--enable-auto-tool-choice``, tools without a tool_choice (auto) are a 400; none,
    required and named choices are served."""
    serving, scripted = scripted_server(long_model, tokenizer)
    with serving as port:
        for choice in (None, "auto"):
            status, reply = post(
                port, "/v1/chat/completions", {"messages": USER, "tools": [WEATHER], "tool_choice": choice}
            )
            assert status == 400 and reply["error"]["param"] == "tool_choice"
            assert reply["error"]["message"] == AUTO_NEEDS_FLAGS
        scripted.script = ['{"city": "Oslo"}']
        for choice in ("none", NAMED):
            status, reply = post(
                port, "/v1/chat/completions", {"messages": USER, "tools": [WEATHER], "tool_choice": choice}
            )
            assert status == 200
        assert reply["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_tokenize_renders_the_tools_as_a_chat_request_does(served, tokenizer):
    port, scripted = served
    body = {"messages": USER, "tools": [WEATHER]}
    scripted.script = ["ok"]
    assert post(port, "/v1/chat/completions", body)[0] == 200
    status, reply = post(port, "/tokenize", body)
    assert status == 200 and reply["tokens"] == scripted.requests[-1][0]


@pytest.fixture(scope="module")
def bundled_port():
    """The bundled model as ``serve --enable-auto-tool-choice --tool-call-parser hermes`` serves it,
    with prompt-exact prefill: decode-consistent (the default) runs a reference prefill on the CPU,
    a cost this test does not need (its semantics are test_decode_consistent_prefill.py's)."""
    from oscar_compile.assembly import assemble
    from oscar_compile.spec import specs_dir

    built = assemble(
        BUNDLED_MODEL_DIR,
        str(specs_dir() / "oscar-int2.yaml"),
        str(BUNDLED_MODEL_DIR / "rotations" / "oscar-int2.safetensors"),
        device="cpu",
        config=EngineConfig(kv_memory_gb=0.05, max_num_seqs=4, max_num_batched_tokens=256,
                            prefill_semantics="prompt-exact"),
    )
    config = ServerConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)
    with running(create_app(AsyncEngine(built.engine), MODEL, config)) as port:
        yield port


@pytest.mark.usefixtures("one_torch_thread")
def test_the_bundled_model_serves_the_captured_bodies_and_langchain_reads_the_answer(bundled_port):
    """Through the real model (which may or may not write a call under auto): every captured body
    is answered with a well-formed message, and LangChain reads it (calls or text)."""
    for name, body in CAPTURED:
        body = {**body, "model": MODEL, "max_tokens": 8, "temperature": 0}
        if body.get("stream"):
            status, events = stream_events(bundled_port, "/v1/chat/completions", body)
            assert status == 200 and events[-1] == "[DONE]" and "error" not in json.loads(events[-2]), name
            continue
        status, reply = post(bundled_port, "/v1/chat/completions", body)
        assert status == 200, (name, reply)
        message = reply["choices"][0]["message"]
        assert message["role"] == "assistant" and (isinstance(message["content"], str) or message["tool_calls"])
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=f"http://127.0.0.1:{bundled_port}/v1",
        api_key="x",
        max_retries=0,
        max_tokens=8,
        temperature=0,
    )
    answer = llm.bind_tools([WEATHER]).invoke("What is the weather in Paris?")
    assert answer.invalid_tool_calls == [] and (answer.content or answer.tool_calls)
