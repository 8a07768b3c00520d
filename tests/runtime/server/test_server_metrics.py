"""/metrics through prometheus_client (issue #30, item 6): the exposition parses, keeps every
existing metric's name and type, and the latency histograms (vLLM's names under ``oscar_``,
vLLM's buckets, labelled by ``model_name``) count each request that goes through the app.

The bundled model, bf16 (no kernel in the interpreter), served as ``serve`` does."""

from __future__ import annotations

import pytest

pytest.importorskip("uvicorn")
parser = pytest.importorskip("prometheus_client.parser")

from server_http import get, post, running, stream_events  # noqa: E402

from oscar_compile.assembly import assemble  # noqa: E402
from oscar_compile.loading import BUNDLED_MODEL_DIR  # noqa: E402
from oscar_compile.runtime.async_engine import AsyncEngine  # noqa: E402
from oscar_compile.runtime.engine_config import EngineConfig  # noqa: E402
from oscar_compile.runtime.server import metrics  # noqa: E402
from oscar_compile.runtime.server.app import create_app  # noqa: E402
from oscar_compile.spec import specs_dir  # noqa: E402

MODEL = "oscar-tiny"
HISTOGRAMS = {"oscar_time_to_first_token_seconds": metrics.TTFT_BUCKETS,
              "oscar_inter_token_latency_seconds": metrics.ITL_BUCKETS,
              "oscar_e2e_request_latency_seconds": metrics.REQUEST_LATENCY_BUCKETS,
              "oscar_request_queue_time_seconds": metrics.REQUEST_LATENCY_BUCKETS}
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def served():
    config = EngineConfig(kv_memory_gb=0.05, max_num_seqs=4, max_num_batched_tokens=32)
    built = assemble(BUNDLED_MODEL_DIR, str(specs_dir() / "bf16.yaml"), None, device="cpu", config=config)
    async_engine = AsyncEngine(built.engine)
    app = create_app(async_engine, [MODEL, "alias"])
    with running(app) as port:
        yield port, app, async_engine


def _families(port: int) -> dict:
    status, text = get(port, "/metrics")
    assert status == 200
    return {family.name: family for family in parser.text_string_to_metric_families(text)}


def _histogram(families: dict, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative buckets as (le, count), count, sum) of the one ``model_name`` series."""
    family = families[name]
    assert family.type == "histogram"
    assert {s.labels["model_name"] for s in family.samples} == {MODEL}  # the first served name
    buckets = [(float(s.labels["le"]), s.value) for s in family.samples if s.name == name + "_bucket"]
    count = next(s.value for s in family.samples if s.name == name + "_count")
    total = next(s.value for s in family.samples if s.name == name + "_sum")
    return buckets, count, total


def test_the_exposition_parses_and_keeps_the_metrics_it_had(served):
    port, *_ = served
    families = _families(port)
    want = {"oscar_requests_waiting": "gauge", "oscar_requests_running": "gauge",
            "oscar_requests_finished": "counter", "oscar_generation_tokens": "counter",
            "oscar_prefix_cache_hit_rate": "gauge", "oscar_kv_pages_used": "gauge",
            "oscar_jit_compiles_while_serving": "counter", "oscar_tensor_parallel_size": "gauge",
            "oscar_kv_rank_pages_total": "gauge", "oscar_ignored_request_fields": "counter",
            "oscar_attention_kernel_info": "gauge", **dict.fromkeys(HISTOGRAMS, "histogram")}
    assert {name: families[name].type for name in want} == want  # (the parser drops a counter's _total)
    assert {s.labels["kind"] for s in families["oscar_kv_pages_used"].samples} == set(metrics.PAGE_KINDS)
    for name, bounds in HISTOGRAMS.items():
        buckets, *_ = _histogram(families, name)
        assert [le for le, _ in buckets] == [*bounds, float("inf")]  # vLLM's buckets


def test_histograms_count_each_request(served):
    port, *_ = served
    before = _families(port)
    lengths = [1, 4, 7]
    for n in lengths:
        body = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": n, "ignore_eos": True}
        assert post(port, "/v1/completions", body)[0] == 200
    chat = {"model": "alias", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True,
            "stream": True}
    assert stream_events(port, "/v1/chat/completions", chat)[0] == 200
    lengths.append(5)
    # prompt scoring: finishes after its prefill without an output token (an e2e, no TTFT)
    score = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 0, "echo": True, "logprobs": 1}
    assert post(port, "/v1/completions", score)[0] == 200
    after = _families(port)
    delta = {}
    for name in HISTOGRAMS:
        buckets, count, total = _histogram(after, name)
        _, count0, total0 = _histogram(before, name)
        counts = [c for _, c in buckets]
        assert counts == sorted(counts) and counts[-1] == count  # cumulative, +Inf holds them all
        delta[name] = (count - count0, total - total0)
    num_requests = len(lengths)
    assert delta["oscar_time_to_first_token_seconds"][0] == num_requests
    assert delta["oscar_inter_token_latency_seconds"][0] == sum(lengths) - num_requests
    assert delta["oscar_e2e_request_latency_seconds"][0] == num_requests + 1
    assert delta["oscar_request_queue_time_seconds"][0] == num_requests + 1
    sums = {name: total for name, (_, total) in delta.items()}
    assert all(total > 0 for total in sums.values())
    # per request e2e >= TTFT >= queue; the scoring request adds an e2e and a queue time, no TTFT
    assert sums["oscar_e2e_request_latency_seconds"] > sums["oscar_time_to_first_token_seconds"]
    assert sums["oscar_e2e_request_latency_seconds"] > sums["oscar_request_queue_time_seconds"]


def test_each_app_has_its_own_registry(served):
    """A second app over the same engine registers the same names without a collision, and
    counts nothing of what the first one served."""
    port, app, async_engine = served
    other = create_app(async_engine, "other")
    assert other.state.metrics.registry is not app.state.metrics.registry
    post(port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "ignore_eos": True})
    families = {f.name: f for f in parser.text_string_to_metric_families(other.state.metrics.render().decode())}
    for name in HISTOGRAMS:
        family = families[name]
        assert all(s.value == 0 for s in family.samples if s.name == name + "_count")
        assert {s.labels["model_name"] for s in family.samples} == {"other"}
