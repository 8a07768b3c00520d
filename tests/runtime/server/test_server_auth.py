"""API keys: wrong, missing and right keys on every route; the serve flags that set them."""

from __future__ import annotations

import http.client
import json
import logging

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from server_http import running  # noqa: E402

from oscar_compile.runtime import serve  # noqa: E402
from oscar_compile.runtime.async_engine import AsyncEngine  # noqa: E402
from oscar_compile.runtime.engine_config import EngineConfig, build_engine  # noqa: E402
from oscar_compile.runtime.server import gate  # noqa: E402
from oscar_compile.runtime.server.app import create_app  # noqa: E402
from oscar_compile.runtime.server.server_config import ServerConfig  # noqa: E402

MODEL = "tiny"
KEY = "sk-test-0123456789"
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def _app(tiny_model, tokenizer, **config):
    engine = build_engine(tiny_model, tokenizer, EngineConfig(num_window_pages=0, num_quant_pages=64))
    return create_app(AsyncEngine(engine), MODEL, ServerConfig(api_key=KEY, **config))


@pytest.fixture(scope="module")
def keyed(tiny_model, tokenizer):
    with running(_app(tiny_model, tokenizer)) as port:
        yield port


@pytest.fixture(scope="module")
def keyed_metrics(tiny_model, tokenizer):
    with running(_app(tiny_model, tokenizer, metrics_require_key=True)) as port:
        yield port


def request(port: int, method: str, path: str, authorization: str | None = None,
            body: dict | None = None) -> tuple[int, dict | str, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
    response = conn.getresponse()
    raw = response.read().decode()
    conn.close()
    try:
        return response.status, json.loads(raw), response
    except json.JSONDecodeError:
        return response.status, raw, response


ROUTES = [("POST", "/v1/completions", COMPLETION),
          ("POST", "/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                            "messages": [{"role": "user", "content": "hi"}]}),
          ("GET", "/v1/models", None)]


@pytest.mark.parametrize("method, path, body", ROUTES + [("GET", "/v1/no-such-route", None)])
@pytest.mark.parametrize("authorization, why", [
    (None, "missing"), ("Bearer wrong-key", "wrong"), (f"Basic {KEY}", "wrong scheme"),
    (f"Bearer {KEY}x", "longer"), (f"Bearer {KEY[:-1]}", "prefix"), ("Bearer ", "empty"),
])
def test_a_missing_or_wrong_key_gets_401_on_every_v1_route(keyed, method, path, body, authorization, why):
    status, payload, response = request(keyed, method, path, authorization, body)
    assert status == 401, why
    assert payload["error"]["code"] == "invalid_api_key" and payload["error"]["type"] == "invalid_request_error"
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert response.getheader("WWW-Authenticate") == "Bearer"


@pytest.mark.parametrize("method, path, body", ROUTES)
def test_the_right_key_is_served(keyed, method, path, body):
    status, payload, _ = request(keyed, method, path, f"Bearer {KEY}", body)
    assert status == 200, payload
    assert request(keyed, method, path, f"bearer   {KEY}  ", body)[0] == 200  # scheme is case-insensitive


def test_the_openai_client_with_and_without_the_key(keyed):
    base = f"http://127.0.0.1:{keyed}/v1"
    client = openai.OpenAI(api_key=KEY, base_url=base, max_retries=0)
    assert client.completions.create(**COMPLETION).choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(api_key="nope", base_url=base, max_retries=0).models.list()
    assert info.value.body["code"] == "invalid_api_key"


def test_health_and_metrics_stay_open_unless_metrics_require_the_key(keyed, keyed_metrics):
    assert request(keyed, "GET", "/health")[0] == 200
    assert request(keyed, "GET", "/metrics")[0] == 200
    assert request(keyed_metrics, "GET", "/health")[0] == 200
    assert request(keyed_metrics, "GET", "/metrics")[0] == 401
    assert request(keyed_metrics, "GET", "/metrics", "Bearer wrong")[0] == 401
    status, text, _ = request(keyed_metrics, "GET", "/metrics", f"Bearer {KEY}")
    assert status == 200 and "oscar_requests_running" in text


def test_keys_are_compared_in_constant_time(keyed, monkeypatch):
    """Through hmac.compare_digest on fixed-length digests (so neither content nor length leaks)."""
    calls = []
    real = gate.hmac.compare_digest

    def spy(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(gate.hmac, "compare_digest", spy)
    request(keyed, "GET", "/v1/models", "Bearer short")
    request(keyed, "GET", "/v1/models", f"Bearer {KEY * 10}")
    assert calls == [(32, 32), (32, 32)]


def test_serve_flags_and_the_environment_set_the_key(monkeypatch):
    monkeypatch.delenv("OSCAR_API_KEY", raising=False)
    assert serve.server_config(serve.parse_args([])).api_key is None
    assert serve.server_config(serve.parse_args(["--api-key", "k1"])).api_key == "k1"
    monkeypatch.setenv("OSCAR_API_KEY", "k2")
    assert serve.server_config(serve.parse_args([])).api_key == "k2"
    assert serve.server_config(serve.parse_args(["--api-key", "k1"])).api_key == "k1"
    with pytest.raises(ValueError, match="must not be empty"):
        serve.server_config(serve.parse_args(["--api-key", ""]))
    monkeypatch.delenv("OSCAR_API_KEY")
    with pytest.raises(ValueError, match="needs an api_key"):
        serve.server_config(serve.parse_args(["--metrics-require-key"]))


@pytest.mark.parametrize("host, key, warns", [
    ("127.0.0.1", None, False), ("localhost", None, False), ("::1", None, False),
    ("0.0.0.0", None, True), ("::", None, True), ("10.1.2.3", None, True), ("myhost", None, True),
    ("0.0.0.0", "k", False),
])
def test_binding_a_non_loopback_address_without_a_key_warns(host, key, warns):
    warning = serve.exposure_warning(host, key)
    assert (warning is not None) == warns
    if warns:
        assert host in warning and "--api-key" in warning


def test_main_logs_the_exposure_warning(model_dir, monkeypatch, caplog):
    """Up to the point where uvicorn would start: the warning is logged before serving."""
    import uvicorn

    from oscar_compile.runtime.server import shutdown

    monkeypatch.delenv("OSCAR_API_KEY", raising=False)
    served = []
    monkeypatch.setattr(shutdown.DrainingServer, "run", lambda self, sockets=None: served.append(self.config))
    with caplog.at_level(logging.WARNING, logger="oscar_compile.runtime.serve"):
        assert serve.main(["--model", str(model_dir), "--device", "cpu", "--kv-memory", "0.01",
                           "--host", "0.0.0.0"]) == 0
    assert any("without an API key" in r.message for r in caplog.records)
    assert isinstance(served[0], uvicorn.Config) and served[0].host == "0.0.0.0"
