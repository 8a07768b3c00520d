"""Overlapped engine steps (engine.py) give exactly the outputs of one-step-at-a-time stepping.

The compressed runner on the CPU runs the same code path as on a GPU (the device is merely
synchronous there): a step runs tokens the host has not read yet, taking them from the previous
step's sampled ids. Compared with ``overlap_steps=False`` on the same compressed model: tokens,
text, finish reasons and logprobs, through EOS and stop-token stops (one discarded step each),
stop strings, seeded sampling, length limits, preemption, prefix-cache hits and an abort while
a step runs; every page is free at the end.
"""
from __future__ import annotations

import copy
import random

import pytest

from oscar_compile import CompressionSpec, apply, calibrate
from oscar_compile.runtime.core.sampling_params import SamplingParams
from oscar_compile.runtime.engine_config import EngineConfig, build_engine
from oscar_compile.runtime.worker.compressed_runner import compressed_layout, runner_factory

INT2 = CompressionSpec.from_dict({
    "kv_cache": {"bits": 2, "group_size": 16, "sink_tokens": 4, "recent_tokens": 8, "page_size": 4},
    "key": {"rotation": "hadamard"}, "value": {"rotation": "hadamard"},
})
# the BF16 mode: outputs do not depend on how prompts are chunked (INT2 outputs do: a chunk attends
# to its own keys in full precision), so schedules that differ (preemption) must agree exactly
BF16 = CompressionSpec.from_dict({"kv_cache": {"bits": 16, "page_size": 4}, "key": {"rotation": "none"},
                                  "value": {"rotation": "none"}})


@pytest.fixture(scope="module")
def compressed(tiny_model):
    models = {}
    for name, spec in (("int2", INT2), ("bf16", BF16)):
        model = copy.deepcopy(tiny_model)
        models[name] = (apply(model, spec, calibrate(model, spec)), spec)  # Hadamard / none: no data needed
    return models


def _engine(compressed, tokenizer, overlap: bool, **config):
    handle, spec = compressed
    model = handle.model
    layout = compressed_layout(model, spec)
    cfg = EngineConfig(layout=layout, overlap_steps=overlap, **config)
    engine = build_engine(model, tokenizer, cfg, make_runner=runner_factory(handle, layout, cfg))
    assert engine.overlap is overlap
    engine.pending_steps = 0
    run = engine.runner.run

    def counting_run(batch, *pending):
        engine.pending_steps += bool(batch.pending_rows)
        return run(batch, *pending)

    engine.runner.run = counting_run
    return engine


def _run(engine, requests, abort_after: int | None = None):
    seqs = [engine.add_request(list(ids), params) for ids, params in requests]
    outputs = {s.request_id: [] for s in seqs}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
        steps += 1
        if steps == abort_after:
            [aborted] = engine.abort_request(seqs[0].request_id)
            assert aborted.finished
    for pool in (engine.page_manager.window_pool, engine.page_manager.quant_pool):
        assert pool.num_used == 0 and all(count == 0 for count in pool.ref_counts)
    return [dict(ids=s.output_token_ids, reason=s.finish_reason, text=s.detokenizer.text,
                 logprobs=[(lp.token_id, lp.logprob) for lp in s.output_logprobs],
                 streamed=[t for o in outputs[s.request_id] for t in o.new_token_ids])
            for s in seqs]


def _without_logprobs(rows):
    return [{k: v for k, v in row.items() if k != "logprobs"} for row in rows]


def _requests(tokenizer, free_run: list[int]):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(2, 30))] for _ in range(8)]
    return [
        (prompts[0], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)),
        (prompts[0], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[free_run[6]])),
        (prompts[0], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[free_run[3]])),
        (prompts[2], SamplingParams(max_tokens=15, temperature=0.8, top_p=0.9, seed=7, logprobs=2)),
        (prompts[3], SamplingParams(max_tokens=1, temperature=0.0)),
        (prompts[0], SamplingParams(max_tokens=18, temperature=0.0, stop=[tokenizer.decode(free_run[4:6])])),
        (prompts[0][:10] + prompts[5], SamplingParams(max_tokens=12, temperature=0.0, logprobs=0)),
        (prompts[6], SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True)),
    ]


@pytest.mark.parametrize("mode,config", [
    ("int2", dict(num_window_pages=64, num_quant_pages=128, max_num_batched_tokens=512)),
    ("bf16", dict(num_window_pages=1, num_quant_pages=16, max_num_batched_tokens=16)),  # preempts
], ids=["int2-roomy", "bf16-tight"])
def test_overlapped_steps_give_the_outputs_of_plain_steps(compressed, tokenizer, mode, config):
    compressed = compressed[mode]
    probe = _engine(compressed, tokenizer, False, num_window_pages=64, num_quant_pages=128)
    rng = random.Random(0)
    first = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(2, 30))]
    free_run = _run(probe, [(first, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))])[0]["ids"]
    requests = _requests(tokenizer, free_run)
    plain = _run(_engine(compressed, tokenizer, False, **config), requests)
    overlapped_engine = _engine(compressed, tokenizer, True, **config)
    overlapped = _run(overlapped_engine, requests)
    assert _without_logprobs(overlapped) == _without_logprobs(plain)
    for a, b in zip(overlapped, plain, strict=True):  # steps batch other rows together: float rounding differs
        assert [t for t, _ in a["logprobs"]] == [t for t, _ in b["logprobs"]]
        assert [lp for _, lp in a["logprobs"]] == pytest.approx([lp for _, lp in b["logprobs"]], abs=1e-4)
    assert overlapped_engine.pending_steps > 10  # the overlap really ran tokens from the device
    assert [plain[i]["reason"].value for i in (1, 2, 5)] == ["stop"] * 3  # stop tokens, stop string
    for row in plain:
        assert row["streamed"] == row["ids"]
    assert len(plain[4]["ids"]) == 1 and plain[3]["logprobs"]
    if mode == "bf16":
        assert overlapped_engine.scheduler.num_preemptions > 0


def test_an_abort_while_a_step_runs_frees_everything_and_spares_the_others(compressed, tokenizer):
    compressed = compressed["int2"]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, len(tokenizer)) for _ in range(12)] for _ in range(3)]
    requests = [(p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)) for p in prompts]
    config = dict(num_window_pages=32, num_quant_pages=64, max_num_batched_tokens=64)
    plain = _run(_engine(compressed, tokenizer, False, **config), requests)
    overlapped = _run(_engine(compressed, tokenizer, True, **config), requests, abort_after=4)
    assert overlapped[0]["reason"].value == "abort"
    assert overlapped[0]["ids"] == plain[0]["ids"][:len(overlapped[0]["ids"])]
    assert _without_logprobs(overlapped[1:]) == _without_logprobs(plain[1:])


def test_bf16_mode_preemption_keeps_the_outputs_of_a_roomy_pool(compressed, tokenizer):
    """Real pages (not a recompute-only runner): a pool too small for the batch preempts and
    recomputes, yet every request ends with what a pool that never preempts gives."""
    compressed = compressed["bf16"]
    probe = _engine(compressed, tokenizer, False, num_window_pages=64, num_quant_pages=128)
    rng = random.Random(0)
    first = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(2, 30))]
    free_run = _run(probe, [(first, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))])[0]["ids"]
    requests = [(ids, p) for ids, p in _requests(tokenizer, free_run) if p.temperature == 0.0]
    roomy = _engine(compressed, tokenizer, False, num_window_pages=64, num_quant_pages=128,
                    max_num_batched_tokens=512)
    tight = _engine(compressed, tokenizer, False, num_window_pages=1, num_quant_pages=16,
                    max_num_batched_tokens=16)
    want, got = _run(roomy, requests), _run(tight, requests)
    assert roomy.scheduler.num_preemptions == 0 and tight.scheduler.num_preemptions > 0
    assert [(r["ids"], r["reason"], r["text"]) for r in got] == [(r["ids"], r["reason"], r["text"]) for r in want]


def test_sampling_controls_count_pending_and_recomputed_tokens(compressed, tokenizer):
    """Penalties count the output token still pending on the device (overlapped steps) and the
    tokens of a recomputed sequence (preemption): a tight overlapped pool gives the tokens of a
    roomy plain one, and the controls really changed them."""
    compressed = compressed["bf16"]
    rng = random.Random(2)
    prompts = [[rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(4, 24))] for _ in range(6)]
    controls = [dict(repetition_penalty=1.6), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
                dict(frequency_penalty=0.8, presence_penalty=0.5, repetition_penalty=1.2, logit_bias={7: 3.0}),
                dict(min_tokens=18, temperature=0.9, min_p=0.1, seed=3), dict(repetition_penalty=1.4, logprobs=1)]
    requests = [(p, SamplingParams(**{"max_tokens": 20, "temperature": 0.0, **c}))
                for p, c in zip(prompts, controls, strict=True)]
    roomy = _engine(compressed, tokenizer, False, num_window_pages=64, num_quant_pages=128,
                    max_num_batched_tokens=512)
    tight = _engine(compressed, tokenizer, True, num_window_pages=1, num_quant_pages=16,
                    max_num_batched_tokens=16)
    want, got = _run(roomy, requests), _run(tight, requests)
    assert tight.scheduler.num_preemptions > 0 and tight.pending_steps > 10
    assert [(r["ids"], r["reason"]) for r in got] == [(r["ids"], r["reason"]) for r in want]
    assert len(want[4]["ids"]) >= 18  # min_tokens: no EOS before 18 tokens
    plain = [(p, SamplingParams(max_tokens=20, temperature=0.0)) for p in prompts[:4]]
    free = _run(_engine(compressed, tokenizer, False, num_window_pages=64, num_quant_pages=128), plain)
    assert all(f["ids"] != w["ids"] for f, w in zip(free, want[:4], strict=True))
