"""Tool-call output, without a model: the hermes parser (whole and streamed), the schemas a forced
``tool_choice`` maps to, and the conversion of a constrained output into ``tool_calls``."""

from __future__ import annotations

import json

import pytest

from oscar_compile.runtime.core.sampling_params import RequestError, SamplingParams, StructuredOutputParams
from oscar_compile.runtime.server.protocol import ChatCompletionRequest
from oscar_compile.runtime.server.tool_calls import (
    AUTO_NEEDS_FLAGS,
    ToolCallPlan,
    plan_tool_calls,
    with_tool_constraint,
)
from oscar_compile.runtime.server.tool_choice import NamedCall, RequiredCalls, function_schema, required_schema
from oscar_compile.runtime.server.tool_parsers import TOOL_PARSERS, get_tool_parser
from oscar_compile.runtime.server.tool_protocol import Tool

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
HERMES = TOOL_PARSERS["hermes"]()


def tools(*raw) -> list[Tool]:
    return [Tool.model_validate(t) for t in raw]


def request(**fields) -> ChatCompletionRequest:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})
    req.check()
    return req


def accumulate(deltas: list[dict]) -> tuple[str, list[dict]]:
    """What a client rebuilds from streamed deltas (the ``openai`` client's rule): content
    concatenated, each call's first entry giving id / type / name, arguments appended by index."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        for entry in delta.get("tool_calls", []):
            assert sum(e["index"] == entry["index"] for e in delta["tool_calls"]) == 1  # one entry per index
            if entry["index"] not in calls:
                assert {"id", "type"} <= set(entry) and entry["function"]["name"]  # the first entry
                calls[entry["index"]] = {"id": entry["id"], "name": entry["function"]["name"], "arguments": ""}
            else:
                assert "id" not in entry and "name" not in entry["function"]
            calls[entry["index"]]["arguments"] += entry["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


def stream_pieces(stream, pieces: list[str]) -> list[dict]:
    return [stream.feed(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]


def chop(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


# --- hermes ------------------------------------------------------------------------------------

TWO_CALLS = (
    'Let me look.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_hermes_reads_content_and_calls():
    out = HERMES.extract(TWO_CALLS)
    assert out.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert len({c.id for c in out.calls}) == 2 and all(c.id.startswith("chatcmpl-tool-") for c in out.calls)
    only = HERMES.extract('<tool_call>{"name": "f", "arguments": {"a": [1, "é"]}}</tool_call>')
    assert only.content is None and only.calls[0].arguments == '{"a": [1, "é"]}'


@pytest.mark.parametrize(
    "text",
    [
        "no calls at all",
        '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>',  # not JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>oops</tool_call>',  # one bad block
    ],
)
def test_hermes_without_valid_calls_returns_the_text_as_content(text):
    out = HERMES.extract(text)
    assert out.content == text and out.calls == []


def test_arguments_are_kept_as_written_or_re_serialized_out_of_order():
    spaced = '<tool_call>{"name": "f", "arguments": {"a" :1,\n "b": [ ]}}</tool_call>'
    assert HERMES.extract(spaced).calls[0].arguments == '{"a" :1,\n "b": [ ]}'
    swapped = '<tool_call>{"arguments": {"a" :1}, "name": "f"}</tool_call>'
    assert HERMES.extract(swapped).calls[0].arguments == '{"a": 1}'
    as_string = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert HERMES.extract(as_string).calls[0].arguments == '{"a": 1}'
    for text in (spaced, swapped, as_string):
        for size in (1, 3):
            _, calls = accumulate(stream_pieces(HERMES.stream(), chop(text, size)))
            assert [c["arguments"] for c in calls] == [HERMES.extract(text).calls[0].arguments]


def test_hermes_reads_an_unclosed_last_block():
    out = HERMES.extract('<tool_call>\n{"name": "get_time", "arguments": {}}\n')
    assert out.content is None and [c.name for c in out.calls] == ["get_time"]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(
    "text",
    [
        TWO_CALLS,
        "plain text with a < sign and <tool and <tool_c",
        "x\n\n  ",
        '<tool_call>{"name": "f", "arguments": {"a": "</tool"}}</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n',
    ],
)
def test_hermes_streamed_rebuilds_what_the_whole_output_gives(text, size):
    whole = HERMES.extract(text)
    content, calls = accumulate(stream_pieces(HERMES.stream(), chop(text, size)))
    assert content == (whole.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole.calls]


def test_hermes_streams_the_call_header_before_the_arguments():
    stream = HERMES.stream()
    assert stream.feed("Sure <tool_") == {"content": "Sure"}  # the tag's start and the space are held
    assert stream.feed('call>{"name": "get_wea') == {}
    header = stream.feed('ther", "arguments": ')
    assert header["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert set(header["tool_calls"][0]) == {"index", "id", "type", "function"} and stream.num_calls == 1
    # then the arguments object as it is written, the outer brace and the closing tag left out
    assert stream.feed('{"city": ') == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}
    assert stream.feed('"Oslo"}}</tool') == {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}
    assert stream.feed("_call>", final=True) == {}


def test_get_tool_parser_names_the_known_ones():
    assert isinstance(get_tool_parser("hermes"), TOOL_PARSERS["hermes"])
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


# --- forced choices: the schema, and the output back to calls -----------------------------------


def test_a_named_choice_constrains_the_output_to_the_function_arguments():
    plan, constraint = plan_tool_calls(
        request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        parser=None,
        auto_enabled=False,
    )
    assert constraint == StructuredOutputParams(json=WEATHER["function"]["parameters"], param="tool_choice")
    message, finish = plan.message('{"city": "Paris"}', "stop")
    assert message["content"] is None and finish == "stop"  # OpenAI's and vLLM's for a named function
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert function_schema(tools(TIME)[0]) == {"type": "object", "properties": {}}


def test_required_schema_is_an_array_of_calls_to_any_tool():
    schema = required_schema(tools(WEATHER, TIME), parallel_tool_calls=None)
    good = [
        {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}},
        {"name": "get_time", "parameters": {}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {"unit": "C"}}],  # city is required
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_time"}],
        [{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "K"}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_schema(tools(WEATHER, TIME), parallel_tool_calls=False)
    jsonschema.validate(good[:1], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)


def test_required_schema_lifts_each_tools_defs_to_the_top():
    with_defs = {
        "type": "function",
        "function": {
            "name": "move",
            "parameters": {
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/point"}},
                "required": ["to"],
                "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
            },
        },
    }
    schema = required_schema(tools(with_defs, TIME), None)
    assert "point" in schema["$defs"] and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    jsonschema.validate([{"name": "move", "parameters": {"to": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "move", "parameters": {"to": {"y": 1}}}], schema)
    clash = json.loads(json.dumps(with_defs).replace('"move"', '"jump"').replace('"number"', '"string"'))
    with pytest.raises(RequestError) as err:
        required_schema(tools(with_defs, clash), None)
    assert err.value.param == "tools.1.function.parameters"


REQUIRED_OUT = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'


def test_a_required_output_becomes_calls():
    plan, constraint = plan_tool_calls(request(tools=[WEATHER, TIME], tool_choice="required"), None, False)
    assert constraint.json == required_schema(tools(WEATHER, TIME), None) and constraint.param == "tool_choice"
    message, finish = plan.message(REQUIRED_OUT, "stop")
    assert message["content"] is None and finish == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    cut = REQUIRED_OUT[:30]  # max_tokens ran out: no calls, the text as content, finish "length"
    assert plan.message(cut, "length") == ({"role": "assistant", "content": cut}, "length")


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_forced_outputs_stream_as_the_whole_output_reads(size):
    for reader, text in ((RequiredCalls(), REQUIRED_OUT), (RequiredCalls(), " [ ]"), (NamedCall("f"), '{"a": 1}')):
        whole = reader.extract(text)
        content, calls = accumulate(stream_pieces(reader.stream(), chop(text, size)))
        assert content == (whole.content or "")
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole.calls]
    deltas = stream_pieces(RequiredCalls().stream(), chop(REQUIRED_OUT, 1))  # arguments as they are written
    assert (
        sum(
            "arguments" in e["function"] and "name" not in e["function"]
            for d in deltas
            for e in d.get("tool_calls", [])
        )
        > 4
    )
    first = NamedCall("f").stream().feed('{"a', final=False)  # a named call starts at once
    assert first["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a'}


def test_parallel_tool_calls_false_keeps_one_call():
    plan = ToolCallPlan(HERMES, max_calls=1)
    message, _ = plan.message(TWO_CALLS, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    content, calls = accumulate(stream_pieces(plan.stream(), chop(TWO_CALLS, 5)))
    assert [c["name"] for c in calls] == ["get_weather"]


def test_auto_needs_the_server_flags_and_none_is_a_plain_chat():
    req = request(tools=[WEATHER])  # no tool_choice: "auto", as vLLM defaults it
    for parser, enabled in ((None, False), (HERMES, False)):
        with pytest.raises(RequestError) as err:
            plan_tool_calls(req, parser, enabled)
        assert err.value.param == "tool_choice" and str(err.value) == AUTO_NEEDS_FLAGS
    plan, constraint = plan_tool_calls(req, HERMES, True)
    assert plan.reader is HERMES and constraint is None
    assert plan_tool_calls(request(tools=[WEATHER], tool_choice="none"), HERMES, True) == (None, None)
    assert plan_tool_calls(request(), HERMES, True) == (None, None)


def test_a_forced_choice_cannot_join_another_constraint():
    schema = StructuredOutputParams(json={"type": "object"}, param="tool_choice")
    assert with_tool_constraint(SamplingParams(), schema).structured_output == schema
    assert with_tool_constraint(SamplingParams(), None).structured_output is None
    with pytest.raises(RequestError) as err:
        with_tool_constraint(SamplingParams(structured_output=StructuredOutputParams(json_object=True)), schema)
    assert err.value.param == "tool_choice"
