"""The ingress checks a request with the engine's own code, on limits a replica sent it: the
answers must be the engine's, for every check."""

import pickle

import pytest

from oscar_compile.runtime.core.sampling_params import RequestError, SamplingParams
from oscar_compile.runtime.server.ray_serve.limits import EngineLimits, LimitsView


@pytest.fixture(scope="module")
def engine():
    from oscar_compile.cli.serve import engine_config, parse_args
    from oscar_compile.cli.serve_replicas import EngineRecipe

    args = parse_args(["--device", "cpu", "--kv-memory", "0.01", "--max-num-seqs", "4", "--snapshot-interval", "256"])
    engine, _ = EngineRecipe(None, None, None, engine_config(args), "cpu")()
    return engine


def _outcome(fn, *args):
    try:
        return fn(*args)
    except RequestError as err:
        return ("error", err.param, str(err), err.code)


def test_the_view_answers_as_the_engine(engine):
    limits = pickle.loads(pickle.dumps(EngineLimits.of(engine)))  # it crosses processes
    view = LimitsView(limits)
    assert limits.routing_interval == 256 and view.max_model_len == engine.max_model_len
    cases = [([5] * 10, SamplingParams(max_tokens=16)), ([5] * 5000, SamplingParams(max_tokens=1)),
             ([], SamplingParams()), ([9999999], SamplingParams()), ([5] * 10, SamplingParams(n=5)),
             ([5] * 10, SamplingParams(n=2, max_tokens=8)), ([5] * 3000, SamplingParams(max_tokens=4000)),
             ([5] * 10, SamplingParams(logit_bias={10**7: 1.0}))]
    ours, theirs = view.input_processor, engine.input_processor

    def check(processor, ids, params):
        processor.process(ids, params, request_id="r", arrival_time=0.0)

    for ids, params in cases:
        assert _outcome(check, ours, ids, params) == _outcome(check, theirs, ids, params)
    refused = [c for c in cases if _outcome(check, theirs, *c) is not None]
    assert len(refused) >= 5  # the cases reach the checks that refuse
    for num_prompt in (0, 1, 100, 1000, 4000, 5000):
        for n in (1, 2, 4):
            assert ours.max_new_tokens(num_prompt, n) == theirs.max_new_tokens(num_prompt, n)
