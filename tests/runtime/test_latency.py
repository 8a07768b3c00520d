"""The engine's latency observations (runtime/latency.py): one queue time, one time to first token
and one end-to-end latency per request (one prompt, whatever its n), one inter-token latency per
later token of each choice, on the same monotonic clock as the arrival the caller stamps."""

from __future__ import annotations

import time

import pytest

from oscar_compile.runtime.core.sampling_params import SamplingParams
from oscar_compile.runtime.engine_config import EngineConfig, build_engine
from oscar_compile.runtime.latency import StepLatencies


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("overlap", [True, False])
def test_each_request_is_observed_once_per_event(tiny_model, tokenizer, overlap, n):
    engine = build_engine(tiny_model, tokenizer, EngineConfig(num_window_pages=0, num_quant_pages=64,
                                                              max_num_batched_tokens=16, overlap_steps=overlap))
    lengths = [1, 3, 6]
    arrival = time.monotonic() - 10.0  # came in 10 s ago: every latency but the inter-token ones is >= 10 s
    for i, length in enumerate(lengths):
        engine.add_request([5 + i] * (7 + 5 * i), SamplingParams(max_tokens=length, ignore_eos=True, n=n,
                                                                 temperature=1.0), arrival_time=arrival)
    seen = StepLatencies()
    while engine.has_unfinished():
        engine.step()
        for name in ("queue", "time_to_first_token", "inter_token", "e2e"):
            getattr(seen, name).extend(getattr(engine.latencies, name))
    # the units of requests_finished_total: one per prompt
    assert len(seen.queue) == len(seen.time_to_first_token) == len(seen.e2e) == len(lengths)
    assert engine.stats()["num_requests_finished"] == len(lengths)
    assert len(seen.inter_token) == n * (sum(lengths) - len(lengths))
    assert min(seen.queue) >= 10.0 and min(seen.time_to_first_token) >= 10.0
    assert sum(seen.e2e) >= sum(seen.time_to_first_token) >= sum(seen.queue)
    # each choice's inter-token latencies add up to at most its request's first token -> finish span
    assert sum(seen.inter_token) <= n * (sum(seen.e2e) - sum(seen.time_to_first_token)) + 1e-6
    assert all(x >= 0 for x in seen.inter_token)


def test_aborted_requests_have_no_end_to_end_latency(tiny_model, tokenizer):
    engine = build_engine(tiny_model, tokenizer, EngineConfig(num_window_pages=0, num_quant_pages=64))
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), request_id="a")
    engine.step()
    engine.step()
    engine.abort_request("a")
    e2e = list(engine.latencies.e2e)
    while engine.has_unfinished():  # the step still in flight (overlap) is read and dropped
        engine.step()
        e2e += engine.latencies.e2e
    assert e2e == []
