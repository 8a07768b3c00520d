"""Structured output through the server, on the bundled model: ``response_format`` and vLLM's
``structured_outputs`` on both routes, streamed and not; errors naming their field; the body
LangChain's ``with_structured_output`` sends (captured by fixtures/capture_langchain.py) and the
real LangChain client."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from server_http import post, running, stream_events  # noqa: E402

from oscar_compile.loading import BUNDLED_MODEL_DIR  # noqa: E402
from oscar_compile.runtime.async_engine import AsyncEngine  # noqa: E402
from oscar_compile.runtime.llm import LLM  # noqa: E402
from oscar_compile.runtime.server.app import create_app  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (BUNDLED_MODEL_DIR / "config.json").exists(), reason="the bundled model is not shipped"
)
MODEL = "bundled"
FIXTURE = Path(__file__).parent / "fixtures" / "langchain_openai_1.8.1_with_structured_output.json"
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "rating": {"type": "number"},
        "genre": {"enum": ["drama", "comedy", "horror"]},
        "sequel": {"type": "boolean"},
        "cast": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "studio": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["title", "year", "rating", "genre", "sequel", "cast", "studio"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "movie", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a movie as JSON."}]


@pytest.fixture(scope="module")
def server():
    llm = LLM(str(BUNDLED_MODEL_DIR), device="cpu", dtype=torch.float32)
    async_engine = AsyncEngine(llm.engine)
    with running(create_app(async_engine, MODEL)) as port:
        yield port


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{server}/v1", max_retries=0)


def _streamed_text(port: int, path: str, body: dict) -> tuple[str, str]:
    status, events = stream_events(port, path, {**body, "stream": True})
    assert status == 200
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    key = "text" if path.endswith("/completions") and "messages" not in body else None
    text = "".join(
        (c["choices"][0].get(key) if key else c["choices"][0]["delta"].get("content")) or ""
        for c in chunks
        if c["choices"]
    )
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    return text, reasons[-1]


def test_json_schema_on_chat_validates_streamed_and_not(client, server):
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=300, temperature=0, response_format=JSON_SCHEMA_FORMAT
    )
    text = response.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert response.choices[0].finish_reason == "stop"
    assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)  # compact, no free blanks
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 300,
        "temperature": 0.7,
        "seed": 1,
        "response_format": JSON_SCHEMA_FORMAT,
    }
    streamed, reason = _streamed_text(server, "/v1/chat/completions", body)
    jsonschema.validate(json.loads(streamed), SCHEMA)
    assert reason == "stop"


def test_structured_outputs_on_completions_regex_choice_json(client, server):
    regex = client.completions.create(
        model=MODEL,
        prompt="Order id:",
        max_tokens=20,
        temperature=0.8,
        seed=2,
        extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{4}"}},
    )
    assert re.fullmatch("[A-Z]{2}-[0-9]{4}", regex.choices[0].text) and regex.choices[0].finish_reason == "stop"
    choices = ["positive", "negative", 'it\'s "mixed"']
    body = {"model": MODEL, "prompt": "Sentiment:", "max_tokens": 20, "structured_outputs": {"choice": choices}}
    text, reason = _streamed_text(server, "/v1/completions", body)
    assert text in choices and reason == "stop"
    body = {
        "model": MODEL,
        "prompt": "JSON:",
        "max_tokens": 300,
        "temperature": 0,
        "structured_outputs": {"json": json.dumps(SCHEMA)},
    }
    status, response = post(server, "/v1/completions", body)
    assert status == 200 and response["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(response["choices"][0]["text"]), SCHEMA)
    status, response = post(
        server, "/v1/completions", {**body, "structured_outputs": None, "response_format": {"type": "json_object"}}
    )
    assert status == 200 and response["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(response["choices"][0]["text"]), dict)


def test_grammar_on_chat(client):
    grammar = 'root ::= "answer: " ("yes" | "no")'
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    assert response.choices[0].message.content in ("answer: yes", "answer: no")


@pytest.mark.parametrize(
    "path, extra, param",
    [
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}},
                    },
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema.name",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
        ("/v1/completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ("/v1/completions", {"structured_outputs": {"regex": "(unclosed"}, "stream": True}, "structured_outputs.regex"),
        ("/v1/completions", {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ("/v1/completions", {"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs.grammar"),
        ("/v1/completions", {"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
        ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        (
            "/v1/completions",
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
        ),
    ],
)
def test_errors_name_their_field(server, path, extra, param):
    body = {"model": MODEL, "max_tokens": 5, **extra}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": "x"})
    status, response = post(server, path, body)
    assert status == 400 and response["error"]["param"] == param, response


def test_langchain_with_structured_output_payload_is_served():
    """The body ``ChatOpenAI.with_structured_output`` sent (captured from langchain-openai 1.8.1)
    is accepted, and the answer parses into its schema, streamed and not."""
    captured = json.loads(FIXTURE.read_text())
    llm = LLM(str(BUNDLED_MODEL_DIR), device="cpu", dtype=torch.float32)
    with running(create_app(AsyncEngine(llm.engine), "tiny")) as port:
        status, response = post(port, "/v1/chat/completions", captured["invoke"])
        assert status == 200 and response["choices"][0]["finish_reason"] == "stop"
        schema = captured["invoke"]["response_format"]["json_schema"]["schema"]
        jsonschema.validate(json.loads(response["choices"][0]["message"]["content"]), schema)
        text, reason = _streamed_text(port, "/v1/chat/completions", captured["stream"])
        jsonschema.validate(json.loads(text), schema)
        assert reason == "stop"


def test_the_real_langchain_client_gets_its_schema(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int
        languages: list[str]

    llm = langchain_openai.ChatOpenAI(
        model=MODEL,
        api_key="unused",
        base_url=f"http://127.0.0.1:{server}/v1",
        temperature=0,
        max_tokens=200,
        max_retries=0,
    )
    person = llm.with_structured_output(Person).invoke("Describe Ada Lovelace.")
    assert isinstance(person, Person)
