"""One validation, at the front (runtime/input_processor.py): each check runs once per request,
offline and served, and the engine trusts the EngineRequest it gets."""
from __future__ import annotations

import pytest

from oscar_compile.runtime.core.sampling_params import RequestError, SamplingParams
from oscar_compile.runtime.engine_config import EngineConfig, build_engine
from oscar_compile.runtime.input_processor import EngineRequest, InputProcessor
from oscar_compile.runtime.server.protocol import CompletionRequest
from oscar_compile.runtime.server.requests import completion_requests


@pytest.fixture
def engine(tiny_model, tokenizer):
    return build_engine(tiny_model, tokenizer, EngineConfig(num_window_pages=0, num_quant_pages=64,
                                                            max_model_len=64))


@pytest.fixture
def calls(monkeypatch):
    """How many times each stage of the validation ran."""
    counts = {"check_prompt": 0, "check_params": 0, "make_request": 0}
    for name in counts:
        original = getattr(InputProcessor, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(InputProcessor, name, spy)
    return counts


def test_offline_requests_are_checked_once(engine, calls):
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()  # the engine checks nothing again
    assert calls == {"check_prompt": 1, "check_params": 1, "make_request": 1}


def test_a_served_request_is_checked_once_per_prompt(engine, calls):
    req = CompletionRequest(model="m", prompt=[[1, 2], [3, 4, 5]], max_tokens=3)
    requests = completion_requests(engine.input_processor, req, [[1, 2], [3, 4, 5]], "cmpl-x", 5.0)
    assert [(r.request_id, r.prompt_token_ids, r.params.max_tokens, r.arrival_time) for r in requests] == [
        ("cmpl-x-0", [1, 2], 3, 5.0), ("cmpl-x-1", [3, 4, 5], 3, 5.0)]
    assert calls == {"check_prompt": 2, "check_params": 1, "make_request": 2}
    for request in requests:
        engine.add(request)
    assert calls["make_request"] == 2


def test_errors_name_the_field_at_fault(engine):
    processor = engine.input_processor
    with pytest.raises(RequestError) as err:
        processor.process([], SamplingParams(), prompt_param="messages")
    assert err.value.param == "messages"
    with pytest.raises(RequestError) as err:
        processor.process([1] * 64, SamplingParams())
    assert err.value.param == "prompt" and err.value.code == "context_length_exceeded"
    with pytest.raises(RequestError) as err:
        processor.process([1], SamplingParams(stop_token_ids=[10**9]))
    assert err.value.param == "stop_token_ids"
    with pytest.raises(RequestError) as err:
        processor.process([1], SamplingParams(n=65))
    assert err.value.param == "n"
    with pytest.raises(RequestError) as err:
        completion_requests(processor, CompletionRequest(model="m", prompt=[1] * 10, max_tokens=60), [[1] * 10],
                            "cmpl-y", 0.0)
    assert err.value.param == "max_tokens" and err.value.code == "context_length_exceeded"


def test_a_duplicate_running_id_is_refused_by_the_engine(engine):
    request = engine.input_processor.process([1, 2], SamplingParams(max_tokens=4), request_id="r")
    assert isinstance(request, EngineRequest)
    engine.add(request)
    with pytest.raises(RequestError, match="already running"):
        engine.add(request)
