"""The step loop: scheduler -> model runner -> sampler -> sequence updates.

``LLMEngine`` is single-threaded on purpose: one thread owns every Sequence and page. The server
wraps it (async_engine.py) and feeds requests in between steps; offline use goes through llm.py.
Each ``step`` returns one ``RequestOutput`` delta per sequence that produced a token (or ended).

Overlapped steps (``overlap``, on for runners with ``capabilities.pending_tokens``): a step launches
its forward and sampling on the device, then reads the *previous* step's samples (long done by
then) and does that step's host work (stop checks, detokenizing, outputs) while the device runs:
the host never leaves the device idle between decode steps. A sequence's sampled token is pending
until read (``Sequence.num_pending``); the next step already runs it, taking it from the device
(``Batch.pending_rows``). Costs: outputs arrive one step later, and a sequence that stops on EOS
or a stop string runs one discarded step (its pages are freed while that step runs: later steps
that reuse them are queued behind it on the same stream). A sequence at its length limit is not
scheduled while its last token is pending.

Prompt logprobs (``SamplingParams.prompt_logprobs``): the prefill chunks of such a sequence are
``Batch.logit_rows``, so the runner returns the logits of each of their tokens (and of no other
row's); the engine scores them at once (``worker/logprobs.py``, one host sync in those steps
only) and hands the list out with the sequence's first output. ``max_tokens`` 0 then finishes the
sequence after its prefill: its one sampled token is dropped.

Parallel sampling (``SamplingParams.n``, parallel_sampling.py): a request's first choice prefills
the prompt; the step that samples its first token samples every choice's from the same row, and
forks the choices once that step's counters advanced. Outputs carry their choice's ``index``;
``request_finished`` says when the last choice of the request has ended.

Structured output (``SamplingParams.structured_output``): a constrained request waits in the
``structured_output`` manager until its grammar is compiled (off this thread), then is scheduled;
a compile error finishes it alone (``RequestOutput.error``). A step whose sampled rows include a
constrained one samples after the previous step's tokens are read and the grammars advanced by
them, with the bitmask filled on the host while the forward runs: the order is spelled out in
``runtime/structured_output/__init__.py``. A terminated grammar stops its request (``stop``).

Latencies: a step leaves its observations (queue times, first tokens, inter-token gaps,
end-to-end) in ``latencies``, replaced at the next step (runtime/latency.py): the async engine
hands them to the server's histograms; offline, nobody has to read them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from oscar_compile.runtime.core.config import RunnerConfig, SchedulerConfig
from oscar_compile.runtime.core.page_manager import PageManager
from oscar_compile.runtime.core.sampling_params import RequestError, SamplingParams, default_seed
from oscar_compile.runtime.core.scheduler import Scheduler, SchedulerOutput
from oscar_compile.runtime.core.sequence import FinishReason, Sequence
from oscar_compile.runtime.detokenizer import IncrementalDetokenizer
from oscar_compile.runtime.latency import StepLatencies
from oscar_compile.runtime.parallel_sampling import ChoiceForks
from oscar_compile.runtime.structured_output import StructuredOutputManager, xgrammar_manager
from oscar_compile.runtime.worker.logits_controls import LogitsControls, build_controls
from oscar_compile.runtime.worker.logprobs import score_tokens
from oscar_compile.runtime.worker.runner import Batch, ModelRunner
from oscar_compile.runtime.worker.sampler import DeviceSample, Sampler, to_device

logger = logging.getLogger(__name__)
_THROUGHPUT_WINDOW_S = 10.0
_COMPILE_WAIT_S = 0.05


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # 1 = the most likely token; set for prompt logprobs


@dataclass
class RequestOutput:
    """What one request gained in one step (``new_*``) plus its running totals."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_prompt_tokens: int
    # with the first output of a request that asked for them: one per prompt token, the first None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    index: int = 0  # the choice (SamplingParams.n); ``finished`` is this choice's
    request_finished: bool = False  # every choice of the request has ended
    error: Exception | None = None  # why the request failed alone (a grammar that did not compile)


@dataclass
class _Launched:
    """A step on the device whose samples the host has not read: row j of ``sample`` is ``seqs[j]``'s."""

    seqs: list[Sequence]
    sample: DeviceSample
    grammars_advanced: bool = False  # structured output: its tokens were fed to the grammars


@dataclass
class _Forwarded:
    """A step whose forward is queued and whose sampling waits for the grammars (structured
    output): ``logits`` row j is ``seqs[j]``'s."""

    seqs: list[Sequence]
    logits: torch.Tensor
    controls: LogitsControls | None


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer, page_manager: PageManager, scheduler_config: SchedulerConfig,
                 runner_config: RunnerConfig, eos_token_ids: list[int] | tuple[int, ...] = (),
                 structured_output: StructuredOutputManager | None = None):
        """``scheduler_config.max_model_len`` is resolved (``build_engine`` puts the model's in)."""
        self.runner = runner
        self.overlap = runner_config.overlap_steps and runner.capabilities.pending_tokens
        self._in_flight: _Launched | None = None
        self.tokenizer = tokenizer
        self.page_manager = page_manager
        self.max_model_len = scheduler_config.max_model_len
        self.scheduler = Scheduler(page_manager, scheduler_config.max_num_seqs,
                                   scheduler_config.max_num_batched_tokens, self.max_model_len)
        self.sampler = Sampler()
        self.seed = runner_config.seed  # the base of the default seeds (sampling_params.default_seed)
        self.eos_token_ids = frozenset(eos_token_ids)
        self._requests: dict[str, list[Sequence]] = {}  # request id -> its choices so far
        self._forks = ChoiceForks()
        self.num_prompt_tokens_total = 0
        self.num_batched_tokens_total = 0  # every token run, prefill and recomputation included
        self.num_generation_tokens_total = 0
        self.num_requests_finished = 0
        self.num_requests_aborted = 0
        self._recent_tokens: deque[tuple[float, int]] = deque()
        self.latencies = StepLatencies()  # the last step's observations (runtime/latency.py)
        self._structured = structured_output  # made at the first constrained request if None
        self._structured_lock = threading.Lock()

    # ---- requests ----------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError for a request that cannot run; reads only immutable settings,
        so the server may call it from any thread."""
        num_prompt = len(prompt_token_ids)
        if params.prompt_logprobs is not None and not self.runner.capabilities.prompt_logits:
            raise RequestError("prompt_logprobs", "this engine's runner cannot return prompt logprobs")
        if num_prompt < 1:
            raise RequestError("prompt", "prompt must hold at least one token")
        vocab = self.runner.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
               for t in prompt_token_ids):
            raise RequestError("prompt", f"prompt token ids must be integers in [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise RequestError("logit_bias", f"logit_bias token ids must be in [0, {vocab})")
        if params.n > 1 and not self.runner.capabilities.page_copies:
            raise RequestError("n", "this engine's runner cannot fork choices: n must be 1")
        if params.n > self.scheduler.max_num_seqs:
            raise RequestError("n", f"n = {params.n} choices exceed this server's {self.scheduler.max_num_seqs} "
                               "sequences at once (--max-num-seqs)")
        if num_prompt + 1 > self.max_model_len:
            raise RequestError(
                "prompt",
                f"this model's maximum context length is {self.max_model_len} tokens, "
                f"the prompt has {num_prompt} (plus at least 1 to generate)",
                code="context_length_exceeded",
            )
        if (num_prompt > self.scheduler.max_num_batched_tokens and self.page_manager.staging_pool.num_pages
                and not self.page_manager.can_ever_stage(num_prompt)):
            raise RequestError(
                "prompt",
                f"a prompt of {num_prompt} tokens is prefilled in chunks, and its history does not fit the "
                "prefill staging memory: raise --prefill-staging-memory (or --max-num-batched-tokens)",
                code="context_length_exceeded",
            )
        num_tokens = min(num_prompt + params.max_tokens, self.max_model_len)
        if not self.page_manager.can_ever_fit(num_tokens, params.n, num_prompt):
            choices = f" in each of {params.n} choices" if params.n > 1 else ""
            raise RequestError(
                "max_tokens",
                f"{num_tokens} tokens{choices} do not fit the KV cache pages even for one request alone",
                code="context_length_exceeded",
            )

    def max_new_tokens(self, num_prompt_tokens: int, num_choices: int = 1) -> int:
        """The most tokens a prompt of this length may generate in each of ``num_choices``
        choices (context and pages)."""
        limit = min(self.max_model_len, self.page_manager.max_seq_len(num_choices, num_prompt_tokens))
        return max(limit - num_prompt_tokens, 0)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> Sequence:
        """``arrival_time``: when the request came in, by ``time.monotonic()`` (default: now)."""
        params = params if params is not None else SamplingParams()
        self.validate_request(prompt_token_ids, params)
        seq = Sequence(prompt_token_ids, params, request_id, arrival_time)
        if seq.request_id in self._requests:
            raise RequestError("request_id", f"request id {seq.request_id!r} is already running")
        if params.seed is None:
            seq.seed = default_seed(self.seed, seq.request_id)
            logger.debug("request %s samples with the default seed %d", seq.request_id, seq.seed)
        self._add_detokenizer(seq)
        if params.structured_output is not None:
            self.structured_output.add(seq)  # scheduled once its grammar is compiled
        else:
            self.scheduler.add(seq)
        self._requests[seq.request_id] = [seq]
        self.num_prompt_tokens_total += seq.num_prompt_tokens
        return seq

    def _add_detokenizer(self, seq: Sequence) -> None:
        seq.detokenizer = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, seq.params.stop, seq.params.skip_special_tokens)

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Stop every choice of a request now and free its pages: one output per choice that was
        running (none if the request is unknown or already done)."""
        choices = [seq for seq in self._requests.get(request_id, ()) if not seq.is_finished]
        if not choices:
            return []
        self.num_requests_aborted += 1
        for seq in choices:
            self._finish(seq, FinishReason.ABORT)
        return [self._output(seq, [], [], finished=True) for seq in choices]

    def has_unfinished(self) -> bool:
        compiling = self._structured is not None and self._structured.num_waiting > 0
        return self.scheduler.has_unfinished() or self._in_flight is not None or compiling

    @property
    def structured_output(self) -> StructuredOutputManager:
        """The grammar manager (xgrammar over the engine's tokenizer unless one was given); any
        thread may ask for it: the server compiles a request's constraint before submitting it."""
        with self._structured_lock:
            if self._structured is None:
                self._structured = xgrammar_manager(self.tokenizer, self.runner.vocab_size, sorted(self.eos_token_ids))
            return self._structured

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar is ready; fail those whose compile failed."""
        if self._structured is None or not self._structured.num_waiting:
            return []
        if not self.scheduler.has_unfinished() and self._in_flight is None:
            self._structured.wait(_COMPILE_WAIT_S)  # nothing else to run: do not spin
        ready, failed = self._structured.take_ready()
        for seq in ready:
            self.scheduler.add(seq)
        outputs = []
        for seq, err in failed:
            self._finish(seq, FinishReason.ABORT)
            outputs.append(self._output(seq, [], [], finished=True))
            outputs[-1].error = err
        return outputs

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.latencies = StepLatencies()
        failed = self._admit_compiled()
        out = self.scheduler.schedule()
        now = time.monotonic()
        for seq in out.seqs:
            self.latencies.scheduled(seq, now)
        for copy in out.page_copies:  # snapshots restored: before the swaps and forwards that may reuse their pages
            self.runner.copy_pages(copy)
        if out.swap_out or out.swap_in:  # queued before this step's forward, which may reuse the pages
            self.runner.swap(out.swap_out, out.swap_in)
        launched = self._launch(out) if not out.is_empty else None
        previous, self._in_flight = self._in_flight, None
        if isinstance(launched, _Forwarded):  # the forward runs while the grammars take step t's tokens
            if previous is not None:
                self._advance_grammars(previous)
            launched = self._sample(launched)
        outputs = failed + (self._read_samples(previous) if previous is not None else [])
        if not out.is_empty:
            # after the read: block hashes need the real tokens; snapshots taken before the next forward
            for copy in self.scheduler.advance(out):
                self.runner.copy_pages(copy)
            self.num_batched_tokens_total += out.num_batched_tokens
        for parent, choices in self._forks.fork(self.scheduler, self.runner):  # queued before the next forward
            for seq in choices:
                self._add_detokenizer(seq)
            self._requests[parent.request_id] += choices
        if launched is not None:
            if self.overlap:
                self._in_flight = launched
            else:
                outputs += self._read_samples(launched)
        return outputs

    def _launch(self, out: SchedulerOutput) -> _Launched | _Forwarded | None:
        """Run the step's forward; sample the rows whose new tokens reach the last known or
        pending token of their sequence (not mid-prompt chunks). When one of them has a grammar,
        return before sampling (``_Forwarded``): its mask needs the tokens still in flight."""
        pending_src = ({seq.seq_id: j for j, seq in enumerate(self._in_flight.seqs)}
                       if self._in_flight is not None else {})
        batch = self._build_batch(out, pending_src)
        tokens = self._in_flight.sample.token_ids if batch.pending_rows else None
        logits = self.runner.run(batch, tokens) if tokens is not None else self.runner.run(batch)
        if batch.logit_rows:
            self._score_prompts(out, batch, logits[batch.num_seqs:])
            logits = logits[:batch.num_seqs]
        rows = [i for i, (seq, n) in enumerate(zip(out.seqs, out.num_new_tokens, strict=True))
                if seq.num_cached_tokens + n == seq.num_tokens + seq.num_pending]
        if not rows:
            return None
        # a first choice drawing its first token brings the request's other choices: the same row
        seqs, rows = self._forks.expand([out.seqs[i] for i in rows], rows)
        # a decode step samples every row: no gather (and no copy of the index). The logits may
        # then be a replayed CUDA graph's output buffer: sampling is queued before the next replay.
        if rows != list(range(len(out.seqs))):
            logits = logits[to_device(rows, torch.int64, logits.device)]
        # None unless a request uses penalties, logit_bias or min_tokens: then nothing more runs
        controls = build_controls(seqs, self.eos_token_ids, logits.shape[-1], logits.device,
                                  self._in_flight.sample.token_ids if self._in_flight else None, pending_src,
                                  self.sampler.token_cache)
        forwarded = _Forwarded(seqs, logits, controls)
        if self._structured is not None and any(self._structured.is_constrained(s) for s in seqs):
            return forwarded
        return self._sample(forwarded)

    def _sample(self, forwarded: _Forwarded) -> _Launched:
        seqs = forwarded.seqs
        bitmask = self._structured.fill_bitmask(seqs) if self._structured is not None else None
        # the position of the token each row draws: after its known and pending tokens
        sample = self.sampler.sample(forwarded.logits, [s.params for s in seqs], [s.seed for s in seqs],
                                     [s.num_tokens + s.num_pending for s in seqs], forwarded.controls, bitmask)
        for seq in seqs:
            seq.num_pending += 1
        return _Launched(seqs, sample)

    def _advance_grammars(self, launched: _Launched) -> None:
        """Feed a read step's tokens to the grammars of its live rows (once per step)."""
        if launched.grammars_advanced or self._structured is None:
            return
        launched.grammars_advanced = True
        token_ids = launched.sample.result().token_ids
        for seq, token_id in zip(launched.seqs, token_ids, strict=True):
            if not seq.is_finished:
                self._structured.accept(seq, token_id)

    def _score_prompts(self, out: SchedulerOutput, batch: Batch, logits: torch.Tensor) -> None:
        """Fill the prompt logprobs of the ``logit_rows``: the logits at position ``p`` score
        prompt token ``p + 1``. logits: ``[sum of their T_i, V]``, row by row."""
        keep, targets, slots = [], [], []
        offset = 0
        for i in batch.logit_rows:
            seq = out.seqs[i]
            for j, position in enumerate(batch.positions[i]):
                if position + 1 < seq.num_prompt_tokens:
                    keep.append(offset + j)
                    targets.append(seq.token_ids[position + 1])
                    slots.append((seq, position + 1))
            offset += len(batch.positions[i])
        if not keep:
            return
        k = max(seq.params.prompt_logprobs for seq, _ in slots)
        rows = logits if len(keep) == offset else logits[torch.tensor(keep, device=logits.device)]
        scored = score_tokens(rows, targets, k)
        for n, (seq, index) in enumerate(slots):
            top_k = seq.params.prompt_logprobs
            top = list(zip(scored.top_ids[n][:top_k], scored.top_logprobs[n][:top_k], strict=True))
            seq.prompt_logprobs[index] = TokenLogprob(targets[n], scored.logprobs[n], top, scored.ranks[n])

    def _read_samples(self, launched: _Launched) -> list[RequestOutput]:
        """Append a launched step's tokens (waiting for its copies); ended sequences drop theirs."""
        self._advance_grammars(launched)
        result = launched.sample.result()
        now = time.monotonic()  # the host has the tokens: what the client can get
        outputs = []
        for j, seq in enumerate(launched.seqs):
            seq.num_pending -= 1
            if seq.is_finished:  # stopped or aborted while this step ran
                continue
            prompt_logprobs = seq.prompt_logprobs if seq.wants_prompt_logprobs and not seq.num_output_tokens else None
            if seq.params.max_tokens == 0:  # scored the prompt: nothing to generate
                self._finish(seq, FinishReason.LENGTH)
                outputs.append(self._output(seq, [], [], finished=True, prompt_logprobs=prompt_logprobs))
                continue
            logprob = None
            if result.logprobs[j] is not None:
                logprob = TokenLogprob(result.token_ids[j], result.logprobs[j], result.top_logprobs[j] or [])
            self.latencies.token(seq, now)
            outputs.append(self._append_token(seq, result.token_ids[j], logprob))
            outputs[-1].prompt_logprobs = prompt_logprobs
        self._count_generated(sum(len(o.new_token_ids) for o in outputs))
        return outputs

    def _build_batch(self, out: SchedulerOutput, pending_src: dict[int, int]) -> Batch:
        fields: dict[str, list] = {name: [] for name in (
            "seq_ids", "token_ids", "positions", "cache_lens", "history_lens",
            "window_tables", "quant_tables", "context_token_ids", "pending_rows", "pending_src",
            "staging_tables", "staging_ends", "logit_rows")}
        for row, (seq, num_new) in enumerate(zip(out.seqs, out.num_new_tokens, strict=True)):
            L = seq.num_cached_tokens
            ids = seq.token_ids[L:L + num_new]
            if len(ids) < num_new:  # the pending token: one, sampled by the step in flight
                fields["pending_rows"].append(row)
                fields["pending_src"].append(pending_src[seq.seq_id])
                ids = [0]
            fields["seq_ids"].append(seq.seq_id)
            fields["token_ids"].append(ids)
            fields["positions"].append(list(range(L, L + num_new)))
            fields["cache_lens"].append(L)
            fields["history_lens"].append(self.page_manager.history_len(seq))
            fields["window_tables"].append(seq.window_pages)
            fields["quant_tables"].append(seq.quant_pages)
            fields["context_token_ids"].append(seq.token_ids)
            fields["staging_tables"].append(seq.staging_pages)
            if seq.is_staged and L + num_new >= seq.num_tokens:
                fields["staging_ends"].append(row)
            if seq.wants_prompt_logprobs and L + 1 < seq.num_prompt_tokens and seq.prompt_logprobs[-1] is None:
                fields["logit_rows"].append(row)
        for name in ("pending_rows", "pending_src", "staging_ends", "logit_rows"):
            fields[name] = tuple(fields[name])
        if not any(fields["staging_tables"]):
            fields["staging_tables"] = ()
        return Batch(layout=self.page_manager.layout, **fields)

    def _append_token(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> RequestOutput:
        seq.append_token(token_id)
        if logprob is not None:
            seq.output_logprobs.append(logprob)
        reason = self._stop_reason(seq, token_id)
        if reason is not None:
            self._finish(seq, reason)
        return self._output(seq, [token_id], [logprob] if logprob else [], reason is not None)

    def _stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        params = seq.params
        if (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            return FinishReason.STOP  # the stop token's text is not part of the output
        if seq.detokenizer.append(token_id):
            return FinishReason.STOP
        if self._structured is not None and self._structured.is_terminated(seq):
            return FinishReason.STOP  # the grammar is complete (its stop token is not EOS here)
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.finish(seq, reason)
        seq.detokenizer.flush()
        self.sampler.forget(seq.seq_id)
        if self._structured is not None:
            self._structured.remove(seq.seq_id)
        if self._request_finished(seq):
            self._requests.pop(seq.request_id, None)
            self.num_requests_finished += 1
            if reason is not FinishReason.ABORT:
                self.latencies.finished(seq, time.monotonic())

    def _request_finished(self, seq: Sequence) -> bool:
        """Whether every choice of ``seq``'s request has ended (a first choice that was to fork
        and ends before it does ends the request)."""
        return all(s.is_finished for s in self._requests.get(seq.request_id, [seq]))

    def _output(self, seq: Sequence, new_ids: list[int], new_logprobs: list[TokenLogprob],
                finished: bool, prompt_logprobs: list[TokenLogprob | None] | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=new_ids,
            new_text=seq.detokenizer.take_delta(finished), new_logprobs=new_logprobs,
            finished=finished, finish_reason=seq.finish_reason.value if finished else None,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            num_cached_prompt_tokens=seq.num_cached_prompt_tokens, prompt_logprobs=prompt_logprobs,
            index=seq.choice_index, request_finished=finished and self._request_finished(seq))

    # ---- stats -------------------------------------------------------------------------------
    def _count_generated(self, num_tokens: int) -> None:
        now = time.monotonic()
        self.num_generation_tokens_total += num_tokens
        self._recent_tokens.append((now, num_tokens))
        while self._recent_tokens and now - self._recent_tokens[0][0] > _THROUGHPUT_WINDOW_S:
            self._recent_tokens.popleft()

    def generation_tokens_per_s(self) -> float:
        """Generated tokens per second over the last few seconds."""
        now = time.monotonic()
        recent = [(t, n) for t, n in self._recent_tokens if now - t <= _THROUGHPUT_WINDOW_S]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1e-3)
        return sum(n for _, n in recent) / span

    def stats(self) -> dict[str, float]:
        bm = self.page_manager
        # a request whose grammar is compiling waits too (outside the scheduler)
        compiling = self._structured.num_waiting if self._structured is not None else 0
        stats = {"num_waiting": self.scheduler.num_waiting + compiling, "num_running": self.scheduler.num_running,
                 "num_preemptions": self.scheduler.num_preemptions,
                 "num_requests_finished": self.num_requests_finished,
                 "num_requests_aborted": self.num_requests_aborted,
                 "prompt_tokens_total": self.num_prompt_tokens_total,
                 "batched_tokens_total": self.num_batched_tokens_total,
                 "generation_tokens_total": self.num_generation_tokens_total,
                 "generation_tokens_per_s": self.generation_tokens_per_s(),
                 "prefix_cache_hit_rate": bm.prefix_hit_rate,
                 "prefix_cache_queried_tokens": bm.num_prefix_queried_tokens,
                 "prefix_cache_hit_tokens": bm.num_prefix_hit_tokens,
                 "num_swap_preemptions": self.scheduler.num_swap_preemptions,
                 "num_recompute_preemptions": self.scheduler.num_preemptions - self.scheduler.num_swap_preemptions,
                 "num_staged_prefills": bm.num_staged_prefills,
                 "staging_pages_peak": bm.peak_staging_pages}
        swap = bm.swap_space
        stats["swap_space_bytes"] = swap.num_bytes if swap is not None else 0
        stats["swap_space_used_bytes"] = swap.num_used_bytes if swap is not None else 0
        stats["num_swapped"] = swap.num_ranges if swap is not None else 0
        stats["num_swap_ins"] = swap.num_swapped_in if swap is not None else 0
        # tensor parallelism: every rank holds the same page ids (its own KV heads in each), so
        # these page counts are each rank's; the bytes are one rank's pools
        stats["tensor_parallel_size"] = self.runner.capabilities.tensor_parallel_size
        page_bytes = {"window": bm.layout.window_page_bytes, "quant": bm.layout.quant_page_bytes,
                      "staging": bm.layout.window_page_bytes}
        stats["kv_bytes_per_rank"] = sum(pool.num_pages * page_bytes[pool.kind]
                                         for pool in (bm.window_pool, bm.quant_pool, bm.staging_pool))
        for pool in (bm.window_pool, bm.quant_pool, bm.staging_pool):
            stats[f"{pool.kind}_pages_total"] = pool.num_pages
            stats[f"{pool.kind}_pages_used"] = pool.num_used
            stats[f"{pool.kind}_pages_cached"] = pool.num_cached
            stats[f"{pool.kind}_pages_free"] = pool.num_free
            stats[f"{pool.kind}_pages_shared"] = pool.num_shared
        snapshots = bm.snapshots  # window snapshots (decode-consistent prefix hits): taken, hits restored
        stats["window_snapshots_taken"] = snapshots.num_captured if snapshots is not None else 0
        stats["window_snapshot_hits"] = snapshots.num_hits if snapshots is not None else 0
        for kind in ("window", "quant"):  # parallel sampling: the pages choices took at their fork
            stats[f"fork_{kind}_pages_shared"] = bm.num_fork_pages_shared[kind]
            stats[f"fork_{kind}_pages_copied"] = bm.num_fork_pages_copied[kind]
        return stats
