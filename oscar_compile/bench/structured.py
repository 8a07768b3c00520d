"""The structured-output cost row of ``bench.serve`` (``--parts structured``): one engine, one
batch, unconstrained decoding against decoding under a ~10-field JSON schema, in the same run.

A random-weight model of the bench shape (INT2) with the 151,936-token BPE of ``bpe_tokenizer``
(the model's vocabulary is set to that size; the 8B shape has it already), ``batch`` random
prompts of ``prompt_len`` tokens, greedy, ``output_len`` tokens (EOS ignored; a constrained
request ends earlier when its grammar completes). After a warm-up (kernels compiled, CUDA graphs
captured, the grammar backend built):
- ``plain`` and ``json``: wall time, tokens/s, the median decode step while the whole batch runs
  (the fair comparison: constrained rows may finish early), mean time to first token;
- ``json`` also: the host time per decode step spent filling the bitmask and advancing the
  grammars (``mask_ms_per_step``, ``advance_ms_per_step``);
- ``compile_ms``: compiling a new schema (cold: not in the cache), and ``ttft_cold_ms``: the
  time to first token of a batch whose schema is compiled on arrival.
"""

from __future__ import annotations

import copy
import statistics
import time

from oscar_compile.bench.grammar_engines import SCHEMA


def _variant(tag: int) -> dict:
    """SCHEMA under another title: the same cost, a different cache key."""
    return {**copy.deepcopy(SCHEMA), "title": f"record-{tag}"}


def _timed(obj, name: str, sink: list[float]) -> None:
    original = getattr(obj, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - start)

    setattr(obj, name, timed)


def _run(llm, prompts, params, sync) -> dict:
    from oscar_compile.bench.e2e import timed_generate

    run = timed_generate(llm, prompts, params, sync)
    del llm.engine.runner.run, llm.engine.step  # the clock's wrappers: the next run gets its own
    choices = [c for o in run.outputs for c in o.outputs]
    full = [
        s
        for (decode, s, _), (seqs, _) in zip(run.clock.steps, run.clock.shapes, strict=True)
        if decode and seqs == len(prompts)
    ]
    firsts = [t[0] - run.start for t in run.clock.arrivals.values() if t]
    return dict(
        **run.throughput(),
        full_batch_decode_step_ms=statistics.median(full) * 1e3 if full else None,
        num_full_batch_steps=len(full),
        ttft_ms=statistics.mean(firsts) * 1e3 if firsts else None,
        finish_reasons=sorted({c.finish_reason for c in choices}),
    )


def structured_rows(
    model, spec, tokenizer, shape: str, batch: int, prompt_len: int, output_len: int, kv_memory_gb: float | None, sync
) -> list[dict]:
    from oscar_compile.bench.e2e import random_prompts
    from oscar_compile.runtime import LLM, SamplingParams
    from oscar_compile.runtime.core.sampling_params import StructuredOutputParams
    from oscar_compile.runtime.engine_config import EngineConfig

    vocab = model.config.get_text_config().vocab_size
    config = EngineConfig(
        kv_memory_gb=kv_memory_gb,
        max_num_seqs=batch,
        max_model_len=prompt_len + output_len + 1,
        expected_seq_len=prompt_len + output_len,
    )
    llm = LLM(model, spec=spec, tokenizer=tokenizer, config=config)
    plain = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    def constrained(tag: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=output_len,
            temperature=0.0,
            ignore_eos=True,
            structured_output=StructuredOutputParams(json=_variant(tag)),
        )

    # warm-up: kernels, graphs of this batch size, the grammar backend (tokenizer view) and its paths
    warm = random_prompts(batch, prompt_len, vocab, seed=1)
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    llm.generate(warm, [constrained(0)] * batch)
    manager = llm.engine.structured_output
    start = time.perf_counter()
    manager.compile(constrained(1).structured_output).result()
    compile_ms = (time.perf_counter() - start) * 1e3

    prompts = random_prompts(batch, prompt_len, vocab, seed=0)
    row = dict(
        shape=shape, batch=batch, prompt_len=prompt_len, output_len=output_len, vocab_size=vocab, compile_ms=compile_ms
    )
    row["plain"] = _run(llm, prompts, plain, sync)
    fills, advances = [], []
    _timed(manager, "fill_bitmask", fills)
    _timed(manager, "accept", advances)
    row["json"] = _run(llm, prompts, constrained(1), sync)  # compiled above: a cache hit
    steps = max(len(fills), 1)
    row["json"].update(
        mask_ms_per_step=sum(fills) / steps * 1e3,
        advance_ms_per_step=sum(advances) / steps * 1e3,
        num_mask_fills=len(fills),
    )
    cold = _run(llm, random_prompts(batch, prompt_len, vocab, seed=2), constrained(2), sync)  # compiled on arrival
    row["ttft_cold_ms"] = cold["ttft_ms"]
    plain_step, json_step = row["plain"]["full_batch_decode_step_ms"], row["json"]["full_batch_decode_step_ms"]
    row["decode_step_cost"] = json_step / plain_step - 1 if plain_step and json_step else None
    del llm
    return [row]


def print_rows(rows: list[dict]) -> None:
    print(
        f"\n{'shape':>5} {'batch':>5} {'plain ms/step':>13} {'json ms/step':>12} {'cost %':>6} {'mask ms':>7} "
        f"{'adv ms':>6} {'compile ms':>10} {'ttft plain':>10} {'ttft json':>9} {'ttft cold':>9}"
    )
    for r in rows:
        p, j = r["plain"], r["json"]
        cost = 100 * r["decode_step_cost"] if r["decode_step_cost"] is not None else float("nan")
        print(
            f"{r['shape']:>5} {r['batch']:>5} {p['full_batch_decode_step_ms'] or 0:>13.2f} "
            f"{j['full_batch_decode_step_ms'] or 0:>12.2f} {cost:>6.1f} {j['mask_ms_per_step']:>7.2f} "
            f"{j['advance_ms_per_step']:>6.2f} {r['compile_ms']:>10.1f} {p['ttft_ms']:>10.1f} "
            f"{j['ttft_ms']:>9.1f} {r['ttft_cold_ms']:>9.1f}"
        )
