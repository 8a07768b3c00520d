"""The step loop: scheduler -> worker (forward, sampling) -> output processor.

``LLMEngine`` schedules and hands out outputs; it is single-threaded on purpose: one thread owns
every Sequence and page. The server wraps it (async_engine.py) and feeds requests in between
steps; offline use goes through llm.py. Each ``step`` returns one ``RequestOutput`` delta per
sequence that produced a token (or ended). The worker (``worker/model_worker.py``) runs the
forward, scores prompts and samples, and returns typed outputs; the output processor
(``output_processor.py``) detokenizes and checks stops; the counters and the stats snapshot are
``stats.py``.

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
row's); the worker scores them at once (``worker/logprobs.py``, one host sync in those steps
only) and the engine hands the list out with the sequence's first output. ``max_tokens`` 0 then finishes the
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

from oscar_compile.runtime.core.config import RunnerConfig, SchedulerConfig
from oscar_compile.runtime.core.page_manager import PageManager
from oscar_compile.runtime.core.sampling_params import RequestError, SamplingParams, default_seed
from oscar_compile.runtime.core.scheduler import Scheduler, SchedulerOutput
from oscar_compile.runtime.core.sequence import FinishReason, Sequence
from oscar_compile.runtime.core.token_logprob import TokenLogprob
from oscar_compile.runtime.input_processor import EngineRequest, InputProcessor
from oscar_compile.runtime.latency import StepLatencies
from oscar_compile.runtime.output_processor import OutputProcessor, RequestOutput
from oscar_compile.runtime.parallel_sampling import ChoiceForks
from oscar_compile.runtime.stats import EngineCounters, EngineStats, engine_stats
from oscar_compile.runtime.structured_output import StructuredOutputManager, xgrammar_manager
from oscar_compile.runtime.worker.model_worker import ForwardOutput, ModelRunnerOutput, Worker, build_batch
from oscar_compile.runtime.worker.runner import ModelRunner

__all__ = ["LLMEngine", "RequestOutput", "TokenLogprob"]
logger = logging.getLogger(__name__)
_COMPILE_WAIT_S = 0.05


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer, page_manager: PageManager, scheduler_config: SchedulerConfig,
                 runner_config: RunnerConfig, eos_token_ids: list[int] | tuple[int, ...] = (),
                 structured_output: StructuredOutputManager | None = None):
        """``scheduler_config.max_model_len`` is resolved (``build_engine`` puts the model's in)."""
        self.capabilities = runner.capabilities  # what the page manager was built for
        self.overlap = runner_config.overlap_steps and self.capabilities.pending_tokens
        self._in_flight: ModelRunnerOutput | None = None
        self.tokenizer = tokenizer
        self.page_manager = page_manager
        self.max_model_len = scheduler_config.max_model_len
        self.scheduler = Scheduler(page_manager, scheduler_config.max_num_seqs,
                                   scheduler_config.max_num_batched_tokens, self.max_model_len)
        self.seed = runner_config.seed  # the base of the default seeds (sampling_params.default_seed)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.worker = Worker(runner, self.eos_token_ids)
        self.output_processor = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len)
        self.input_processor = InputProcessor(runner.vocab_size, self.max_model_len, scheduler_config.max_num_seqs,
                                              scheduler_config.max_num_batched_tokens, page_manager,
                                              self.capabilities)
        self._requests: dict[str, list[Sequence]] = {}  # request id -> its choices so far
        self._forks = ChoiceForks()
        self.counters = EngineCounters()
        self.latencies = StepLatencies()  # the last step's observations (runtime/latency.py)
        self._structured = structured_output  # made at the first constrained request if None
        self._structured_lock = threading.Lock()

    @property
    def runner(self) -> ModelRunner:
        """The worker's model runner (page copies and swaps are queued on it directly)."""
        return self.worker.runner

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> Sequence:
        """Validate (``input_processor``) and add a request: the front door of offline callers.
        ``arrival_time``: when the request came in, by ``time.monotonic()`` (default: now)."""
        return self.add(self.input_processor.process(prompt_token_ids, params, request_id, arrival_time))

    def add(self, request: EngineRequest) -> Sequence:
        """Add a validated request (checked once, at the front: nothing is checked again but
        that its id is not running already)."""
        params = request.params
        seq = Sequence(request.prompt_token_ids, params, request.request_id, request.arrival_time)
        if seq.request_id in self._requests:
            raise RequestError("request_id", f"request id {seq.request_id!r} is already running")
        if params.seed is None:
            seq.seed = default_seed(self.seed, seq.request_id)
            logger.debug("request %s samples with the default seed %d", seq.request_id, seq.seed)
        self.output_processor.add(seq)
        if params.structured_output is not None:
            self.structured_output.add(seq)  # scheduled once its grammar is compiled
        else:
            self.scheduler.add(seq)
        self._requests[seq.request_id] = [seq]
        self.counters.num_prompt_tokens += seq.num_prompt_tokens
        return seq

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Stop every choice of a request now and free its pages: one output per choice that was
        running (none if the request is unknown or already done)."""
        choices = [seq for seq in self._requests.get(request_id, ()) if not seq.is_finished]
        if not choices:
            return []
        self.counters.num_requests_aborted += 1
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
        if isinstance(launched, ForwardOutput):  # the forward runs while the grammars take step t's tokens
            if previous is not None:
                self._advance_grammars(previous)
            launched = self._sample(launched)
        outputs = failed + (self._read_samples(previous) if previous is not None else [])
        if not out.is_empty:
            # after the read: block hashes need the real tokens; snapshots taken before the next forward
            for copy in self.scheduler.advance(out):
                self.runner.copy_pages(copy)
            self.counters.num_batched_tokens += out.num_batched_tokens
        for parent, choices in self._forks.fork(self.scheduler, self.runner):  # queued before the next forward
            for seq in choices:
                self.output_processor.add(seq)
            self._requests[parent.request_id] += choices
        if launched is not None:
            if self.overlap:
                self._in_flight = launched
            else:
                outputs += self._read_samples(launched)
        return outputs

    def _launch(self, out: SchedulerOutput) -> ModelRunnerOutput | ForwardOutput | None:
        """Run the step's forward; sample the rows whose new tokens reach the last known or
        pending token of their sequence (not mid-prompt chunks). When one of them has a grammar,
        return before sampling (``ForwardOutput``): its mask needs the tokens still in flight."""
        pending_src = self._in_flight.rows_by_seq() if self._in_flight is not None else {}
        batch = build_batch(out, self.page_manager, pending_src)
        rows = [i for i, (seq, n) in enumerate(zip(out.seqs, out.num_new_tokens, strict=True))
                if seq.num_cached_tokens + n == seq.num_tokens + seq.num_pending]
        # a first choice drawing its first token brings the request's other choices: the same row
        seqs, rows = self._forks.expand([out.seqs[i] for i in rows], rows)
        forward, scores = self.worker.execute(batch, out.seqs, seqs, rows, self._in_flight, pending_src)
        for seq, index, score in scores:
            seq.prompt_logprobs[index] = score
        if forward is None or (self._structured is not None and any(self._structured.is_constrained(s) for s in seqs)):
            return forward
        return self._sample(forward)

    def _sample(self, forward: ForwardOutput) -> ModelRunnerOutput:
        bitmask = self._structured.fill_bitmask(forward.seqs) if self._structured is not None else None
        launched = self.worker.sample(forward, bitmask)
        for seq in forward.seqs:
            seq.num_pending += 1
        return launched

    def _advance_grammars(self, launched: ModelRunnerOutput) -> None:
        """Feed a read step's tokens to the grammars of its live rows (once per step)."""
        if launched.grammars_advanced or self._structured is None:
            return
        launched.grammars_advanced = True
        for seq, token_id in zip(launched.seqs, launched.result().token_ids, strict=True):
            if not seq.is_finished:
                self._structured.accept(seq, token_id)

    def _read_samples(self, launched: ModelRunnerOutput) -> list[RequestOutput]:
        """Append a launched step's tokens (waiting for its copies); ended sequences drop theirs."""
        self._advance_grammars(launched)
        result = launched.result()
        now = time.monotonic()  # the host has the tokens: what the client can get
        outputs = []
        for j, seq in enumerate(launched.seqs):
            seq.num_pending -= 1
            if seq.is_finished:  # stopped or aborted while this step ran
                continue
            prompt_logprobs = seq.prompt_logprobs if seq.wants_prompt_logprobs and not seq.num_output_tokens else None
            if seq.params.max_tokens == 0:  # scored the prompt: nothing to generate
                self._finish(seq, FinishReason.LENGTH)
                outputs.append(self._output(seq, [], [], True, prompt_logprobs))
                continue
            token_id, logprob = result.token_ids[j], None
            if result.logprobs[j] is not None:
                logprob = TokenLogprob(token_id, result.logprobs[j], result.top_logprobs[j] or [])
            self.latencies.token(seq, now)
            reason = self.output_processor.append(seq, token_id, logprob, self._structured)
            if reason is not None:
                self._finish(seq, reason)
            outputs.append(self._output(seq, [token_id], [logprob] if logprob else [], reason is not None,
                                        prompt_logprobs))
        self.counters.count_generated(sum(len(o.new_token_ids) for o in outputs))
        return outputs

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.finish(seq, reason)
        self.output_processor.finish(seq)
        self.worker.forget(seq.seq_id)
        if self._structured is not None:
            self._structured.remove(seq.seq_id)
        if self._request_finished(seq):
            self._requests.pop(seq.request_id, None)
            self.counters.num_requests_finished += 1
            if reason is not FinishReason.ABORT:
                self.latencies.finished(seq, time.monotonic())

    def _request_finished(self, seq: Sequence) -> bool:
        """Whether every choice of ``seq``'s request has ended (a first choice that was to fork
        and ends before it does ends the request)."""
        return all(s.is_finished for s in self._requests.get(seq.request_id, [seq]))

    def _output(self, seq: Sequence, new_ids: list[int], new_logprobs: list[TokenLogprob], finished: bool,
                prompt_logprobs: list[TokenLogprob | None] | None = None) -> RequestOutput:
        return self.output_processor.output(seq, new_ids, new_logprobs, finished,
                                     finished and self._request_finished(seq), prompt_logprobs)

    def stats(self) -> EngineStats:
        compiling = self._structured.num_waiting if self._structured is not None else 0
        return engine_stats(self.counters, self.scheduler, self.page_manager, compiling,
                            self.capabilities.tensor_parallel_size)
