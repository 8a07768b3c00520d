"""End-to-end generation benchmark: the runtime (INT2 and BF16 mode) against transformers' continuous batching.

B prompts of ``prompt_len`` random tokens each generate ``output_len`` tokens (greedy, EOS
ignored) on the same random-weight model, through:
- ``oscar-int2`` / ``oscar-bf16``: ``LLM(model, spec)`` - the whole runtime (scheduler, chunked
  prefill, compressed runner with CUDA graphs, sampler, detokenizer);
- ``oscar-int2-prompt-exact`` / ``oscar-int2-no-prefix-caching``: the INT2 runtime with prompt-exact
  prefill, or with prefix caching off (``INT2_VARIANTS``);
- ``hf-cb``: ``model.generate_batch`` - transformers' own continuous batching (paged attention
  with its own CUDA graphs), on the plain model.
Reported per run: wall time, output tokens/s over the whole run (prefill included), and per-user
decode tokens/s, the same way for every system: per request, (tokens - 1) / (time of its last
token - time of its first token), averaged over requests (prefill chunks of other requests that
run meanwhile count in). For the runtime also: the median decode-only step, and the host share
of decode-only steps: the share of the decode phase, on the GPU's clock (CUDA events around each
forward, read after the run; from the first decode-only forward's start to the last one's end),
in which the GPU ran no forward: host work the engine did not overlap with the device
(scheduling, bookkeeping, input packing, sampling, detokenizing). (Host wall time per step does
not work for an overlapped engine: a step returns before its forward ends, and the sums of the
two clocks drifted apart by up to 0.5 % of the phase, a negative share.) The time in decode-only and in
other (prefill / mixed) steps, and the eight slowest steps with their shapes and forward times
(a step far above the median is usually a kernel compile). For mixed steps (decode rows beside
prefill chunks) and prefill-only steps: the median host time inside the runner's ``run()`` (packing
and launching an eager forward) against the median forward on the device's clock, and the median
gap on the device's clock from the forward before to each one's start. The gap is what the host
work cost the device: once the host runs a step ahead, its time in ``run()`` also holds waits for
the device (the step inputs' buffers, room in the launch queue). The warm-up runs the workload's
step shapes on other prompts (every prompt at full length, with outputs long enough that prefill
chunks run beside decode rows);
``jit_compiles_in_warmup`` counts the Triton compiles it made after the engine's own startup
warm-up (what a server would stall on) and ``jit_compiles_timed`` those in the timed run, each
logged with its kernel (``kernels.jit_watch``). The tokenizer is
a stub that spells token ids (random weights need no real vocabulary); it is not cheaper than a
fast tokenizer's decode.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

import torch

from oscar_compile.kernels import jit_watch


class SpelledIdTokenizer:
    """A tokenizer stand-in for random-weight models: token id n decodes to the text ``" tn"``."""

    eos_token_id = None
    pad_token_id = 0

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, **kwargs) -> list[int]:
        return [int(piece[1:]) for piece in text.split()]

    def decode(self, ids, skip_special_tokens: bool = True, **kwargs) -> str:
        return "".join(f" t{i}" for i in ids)


def random_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (batch, prompt_len), generator=g).tolist()


class _StepClock:
    """Times engine steps on the host clock and the device work of their forward with CUDA events
    read after the run (no sync in the loop: an overlapped engine keeps overlapping), and each
    request's token arrivals. The engine's runner must be the compressed one (it records the
    start event: ``CompressedRunner.forward_started``)."""

    def __init__(self, engine):
        self.steps: list[tuple[str, float, tuple | None]] = []  # (kind, step s, forward events)
        self.shapes: list[tuple[int, int]] = []  # (sequences, tokens) of each step's batch
        self.run_host_s: list[float | None] = []  # host time inside the runner's run(), per step
        self.arrivals: dict[str, list[float]] = {}  # request id -> time of each new token
        self._events, self._kind, self._shape, self._run_s = None, "none", (0, 0), None
        run, step = engine.runner.run, engine.step

        def timed_run(batch, *pending):
            start = time.perf_counter()
            events = None
            if torch.cuda.is_available():
                events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                # the runner records the start once the inputs are packed: recorded here, on an idle
                # GPU it would fire at once and count the packing as device time
                engine.runner.forward_started = events[0]
            logits = run(batch, *pending)
            if events is not None:
                engine.runner.forward_started = None
                events[1].record()
            self._events, self._kind, self._shape = events, step_kind(batch), (batch.num_seqs, batch.num_tokens)
            self._run_s = time.perf_counter() - start
            return logits

        def timed_step():
            # a step that schedules nothing runs no model
            self._events, self._kind, self._shape, self._run_s = None, "none", (0, 0), None
            start = time.perf_counter()
            outs = step()
            now = time.perf_counter()
            self.steps.append((self._kind, now - start, self._events))
            self.shapes.append(self._shape)
            self.run_host_s.append(self._run_s)
            for out in outs:
                self.arrivals.setdefault(out.request_id, []).extend([now] * len(out.new_token_ids))
            return outs

        engine.runner.run, engine.step = timed_run, timed_step

    def summary(self) -> dict:
        _sync()
        device_s = [ev[0].elapsed_time(ev[1]) * 1e-3 if ev is not None else None for _, _, ev in self.steps]
        decode = [i for i, (kind, _, _) in enumerate(self.steps) if kind == "decode"]
        step_s = sum(self.steps[i][1] for i in decode)
        host_share = None
        timed = [i for i in decode if self.steps[i][2] is not None]
        if timed:  # on the GPU's clock, from the first decode forward's start to the last one's end;
            # forwards run in stream order, so every forward of the steps in between lies inside
            span_s = self.steps[timed[0]][2][0].elapsed_time(self.steps[timed[-1]][2][1]) * 1e-3
            busy_s = sum(t for t in device_s[timed[0]:timed[-1] + 1] if t is not None)
            host_share = (span_s - busy_s) / span_s if span_s > 0 else None
        slowest = sorted(range(len(self.steps)), key=lambda i: -self.steps[i][1])[:8]
        return dict(decode_steps=len(decode),
                    per_user_tokens_per_s=per_user_rate(list(self.arrivals.values())),
                    # the share of the decode phase in which the device ran no forward
                    host_share_of_decode_step=host_share,
                    decode_step_ms_median=statistics.median(self.steps[i][1] for i in decode) * 1e3 if decode else None,
                    decode_s=step_s, other_steps_s=sum(s for kind, s, _ in self.steps if kind != "decode"),
                    mixed_steps=self._host_and_device("mixed", device_s),
                    prefill_steps=self._host_and_device("prefill", device_s),
                    # where a run's time went when it is slower than its median step says
                    slowest_steps=[dict(index=i, kind=self.steps[i][0], seqs=self.shapes[i][0],
                                        tokens=self.shapes[i][1], step_ms=self.steps[i][1] * 1e3,
                                        forward_ms=device_s[i] * 1e3 if device_s[i] is not None else None)
                                   for i in slowest])

    def _host_and_device(self, kind: str, device_s: list) -> dict | None:
        """Steps of one kind: the median host time inside the runner's ``run()`` (packing the inputs
        and launching the forward, and any wait for the device in it) against the median forward on
        the device's clock (the prefill issue's host-time goal: at most 10 %), and the median gap on
        the device's clock before each of their forwards, from the end of the forward before (the
        sampler's kernels included): what the host work cost the device."""
        rows = [i for i, (k, _, _) in enumerate(self.steps) if k == kind and self.run_host_s[i] is not None]
        if not rows:
            return None
        host_ms = statistics.median(self.run_host_s[i] for i in rows) * 1e3
        timed = [device_s[i] for i in rows if device_s[i] is not None]
        forward_ms = statistics.median(timed) * 1e3 if timed else None
        gaps, before = [], None
        for k, _, events in self.steps:
            if events is None:
                continue
            if k == kind and before is not None:
                gaps.append(before[1].elapsed_time(events[0]))
            before = events
        return dict(count=len(rows), tokens_median=statistics.median(self.shapes[i][1] for i in rows),
                    run_host_ms_median=host_ms, forward_ms_median=forward_ms,
                    host_over_forward=host_ms / forward_ms if forward_ms else None,
                    device_gap_ms_median=statistics.median(gaps) if gaps else None)


def step_kind(batch) -> str:
    """``decode`` (one token per sequence), ``prefill`` (chunks only) or ``mixed`` (both)."""
    sizes = [len(t) for t in batch.token_ids]
    if all(n == 1 for n in sizes):
        return "decode"
    return "mixed" if any(n == 1 for n in sizes) else "prefill"


@dataclass
class TimedRun:
    """One ``llm.generate`` call under its own ``_StepClock``: the outputs, the clock, the host time
    it started at (``time.perf_counter``) and its wall time, the device synced at both ends."""

    outputs: list
    clock: _StepClock
    start: float
    wall_s: float

    def throughput(self) -> dict:
        """Wall time, tokens generated over every choice, and tokens/s over the whole run."""
        generated = sum(len(c.token_ids) for o in self.outputs for c in o.outputs)
        return dict(wall_s=self.wall_s, generated_tokens=generated, tokens_per_s=generated / self.wall_s)


def timed_generate(llm, prompts, params, sync=None) -> TimedRun:
    """``llm.generate(prompts, params)`` timed (``sync``: how to wait for the device; by default
    CUDA's, when there is one)."""
    sync = sync or _sync
    clock = _StepClock(llm.engine)
    sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    sync()
    return TimedRun(outputs, clock, start, time.perf_counter() - start)


def per_user_rate(arrivals: list[list[float]]) -> float | None:
    """Mean over requests of (tokens - 1) / (last token time - first token time)."""
    rates = [(len(t) - 1) / (t[-1] - t[0]) for t in arrivals if len(t) > 1 and t[-1] > t[0]]
    return statistics.mean(rates) if rates else None


def run_runtime(model, spec, prompts, output_len: int, kv_memory_gb: float, max_batched_tokens: int,
                overlap: bool = True, **engine_settings) -> dict:
    """One batch through ``LLM(model, spec)``; ``model`` is rewritten in place (use a fresh one).
    ``engine_settings``: further ``EngineConfig`` fields (a variant system's)."""
    from oscar_compile.runtime import LLM, SamplingParams
    from oscar_compile.runtime.engine_config import EngineConfig

    batch, prompt_len = len(prompts), len(prompts[0])
    vocab = model.config.get_text_config().vocab_size
    config = EngineConfig(kv_memory_gb=kv_memory_gb, max_num_seqs=max(batch, 1),
                          max_num_batched_tokens=max_batched_tokens,
                          max_model_len=prompt_len + output_len + 1, expected_seq_len=prompt_len + output_len,
                          overlap_steps=overlap, **engine_settings)
    llm = LLM(model, spec=spec, tokenizer=SpelledIdTokenizer(vocab), config=config)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    # Triton compiles after the engine's own startup warmup: what a server would stall on
    watching = jit_watch.install()
    compiles = jit_watch.compile_stats()["jit_compiles_total"]
    jit_watch.mark_serving()  # from here on each compile is logged, with its kernel and time
    try:
        # the workload's step shapes on other tokens (no prefix hits): every prompt at full length, and
        # long enough outputs that each prefill step after the first runs beside decode rows, as below
        steps = -(-batch * prompt_len // max_batched_tokens)
        llm.generate(random_prompts(batch, prompt_len, vocab, seed=1),
                     SamplingParams(max_tokens=min(output_len, steps + 4), temperature=0.0, ignore_eos=True))
        warmup_compiles = jit_watch.compile_stats()["jit_compiles_total"] - compiles
        run = timed_generate(llm, prompts, params)
    finally:
        jit_watch.mark_serving(False)
    row = dict(batch=batch, **run.throughput())
    if watching:
        stats = jit_watch.compile_stats()
        row.update(jit_compiles_in_warmup=warmup_compiles,
                   jit_compiles_timed=stats["jit_compiles_total"] - compiles - warmup_compiles)
    row.update(run.clock.summary())
    del llm
    return row


def run_hf_continuous_batching(model, prompts, output_len: int) -> dict:
    """One batch through transformers' ``generate_batch`` (continuous batching, paged attention)."""
    from transformers import GenerationConfig

    batch = len(prompts)
    gen = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0)
    warm = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate_batch(_warmup_prompts(batch, len(prompts[0]), model.config.vocab_size), generation_config=warm)
    _sync()
    outs = model.generate_batch(prompts, generation_config=gen, record_timestamps=True)
    _sync()
    # from the first request's creation to the last one's end: the manager's own warm-up (CUDA
    # graph capture, run before requests are queued) is left out, as it is for the runtime
    wall = max(o.lifespan[1] for o in outs.values()) - min(o.created_time for o in outs.values())
    generated = sum(len(o.generated_tokens) for o in outs.values())
    return dict(batch=batch, wall_s=wall, generated_tokens=generated, tokens_per_s=generated / wall,
                per_user_tokens_per_s=per_user_rate([o.timestamps or [] for o in outs.values()]),
                errors=[o.error for o in outs.values() if o.error][:3])


# Variants of the INT2 runtime (the prefill issue's rows): EngineConfig fields on top of the defaults.
INT2_VARIANTS = {
    "oscar-int2-prompt-exact": dict(prefill_semantics="prompt-exact"),
    "oscar-int2-no-prefix-caching": dict(enable_prefix_caching=False),
}
SYSTEMS = ("oscar-int2", "oscar-bf16", "hf-cb", "oscar-int2-sync", "oscar-bf16-sync", *INT2_VARIANTS)
DEFAULT_SYSTEMS = ("oscar-int2", "oscar-bf16", "hf-cb")


def _system_runs(spec_of_mode: dict) -> dict:
    """System name -> (spec, overlap, EngineConfig fields); spec None is transformers' own batching."""
    runs = {f"oscar-{mode}": (spec, True, {}) for mode, spec in spec_of_mode.items()}
    runs["hf-cb"] = (None, True, {})
    runs.update({f"oscar-{mode}-sync": (spec, False, {}) for mode, spec in spec_of_mode.items()})
    if "int2" in spec_of_mode:
        runs.update({name: (spec_of_mode["int2"], True, settings) for name, settings in INT2_VARIANTS.items()})
    return runs


def e2e_rows(make_model, spec_of_mode: dict, batches: list[int], prompt_len: int, output_len: int,
             kv_memory_gb: float, max_batched_tokens: int, time_limit_s: float, keep=print,
             systems: list[str] | None = None) -> list[dict]:
    """Every system at every batch size; a system skips its remaining sizes once it has used
    ``time_limit_s`` (the row says so), so one slow system cannot eat the whole run. ``keep``
    sees each row as soon as it is measured; ``systems`` picks some of ``SYSTEMS`` (the *-sync
    ones: the runtime with overlapped steps off; the INT2 variants: prompt-exact prefill, prefix
    caching off), in the order given; by default ``DEFAULT_SYSTEMS``."""
    rows = []
    runs = _system_runs(spec_of_mode)
    for name in [name for name in systems or DEFAULT_SYSTEMS if name in runs]:
        spec, overlap, settings = runs[name]
        spent = 0.0
        for batch in batches:
            row = dict(system=name, batch=batch, prompt_len=prompt_len, output_len=output_len)
            if spent > time_limit_s:
                rows.append({**row, "skipped": f"time limit {time_limit_s:.0f} s reached"})
                keep(rows[-1])
                continue
            model = make_model()
            prompts = random_prompts(batch, prompt_len, model.config.get_text_config().vocab_size)
            start = time.perf_counter()
            try:
                if spec is None:
                    row.update(run_hf_continuous_batching(model, prompts, output_len))
                else:
                    row.update(run_runtime(model, spec, prompts, output_len, kv_memory_gb, max_batched_tokens,
                                           overlap=overlap, **settings))
            except Exception as exc:  # a failing system is a result too; keep measuring the others
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            spent += time.perf_counter() - start
            rows.append(row)
            keep(row)
            del model
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def _warmup_prompts(batch: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    """One prompt of the real length (the long-chunk kernel variants compile), the rest short."""
    return random_prompts(1, prompt_len, vocab_size, seed=1) + random_prompts(batch - 1, min(256, prompt_len),
                                                                              vocab_size, seed=2)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
