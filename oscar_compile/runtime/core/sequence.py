"""One request's state as the scheduler and block manager see it: token ids, counters, page lists.

Holds no tensors (plain lists and ints) so the bookkeeping runs and is tested on a CPU. The model
state of a sequence is entirely described by ``num_cached_tokens`` and its page lists; what the
pages hold is the model runner's business.
"""

from __future__ import annotations

import enum
import itertools
import time
from typing import Any

from oscar_compile.runtime.core.sampling_params import SamplingParams, default_seed


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its pages copied to host swap space (waiting to swap in)
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # the client went away or the request was cancelled


_seq_counter = itertools.count()


class Sequence:
    """A request moving through waiting -> running (possibly preempted back) -> finished.

    ``token_ids`` is prompt + output so far. ``num_cached_tokens`` (L) tokens have their K/V in
    the cache; the model has yet to see ``token_ids[L:]``. ``window_pages`` is this sequence's row
    of ``window_table`` (sink pages first, then the recent ring), ``quant_pages`` its row of
    ``quant_table`` (history page ``j`` holds positions ``S0 + jP .. S0 + (j+1)P - 1``).
    ``num_prefix_cached_tokens`` is how many tokens the last admission took from the prefix cache
    (cleared with the pages), ``history_floor`` the history its cache keeps while the ring refills
    after that hit (page_manager; 0 at the sink and at a window snapshot);
    ``num_cached_prompt_tokens`` keeps the prompt's share of it for the usage report, past the
    release of the pages at the finish.
    ``block_hashes[k]`` chains the ids of tokens ``[0, (k+1)P)``; the first
    ``num_committed_blocks`` blocks have final content in the cache and are registered for reuse.
    ``staging_pages`` (non-empty only while a prompt is prefilled in several chunks) is the
    sequence's table of full-precision staging pages: its history rows wait there, unquantized,
    until the last prompt chunk (deferred demotion, see page_manager). ``swap`` is where its
    pages sit in host swap space while it is swapped out: ``(offset, num_window, num_quant)``.
    Parallel sampling (``params.n`` > 1): the request's first sequence is choice 0; once its prompt
    is cached it forks ``num_forks`` more (``fork``; page_manager, "Parallel sampling"), choice
    ``i`` with ``seed + i`` and the seq_id ``child_seq_ids[i - 1]`` reserved at its creation, so
    that the choices sort by arrival right after it. ``fork_window_pages`` / ``fork_quant_pages``
    are the pages reserved for them at admission.
    ``prompt_logprobs`` (only when ``params.prompt_logprobs`` asks): one entry per prompt token,
    ``None`` for the first (nothing predicts it) and until the prefill reaches it; the engine fills
    entry ``p + 1`` from the logits at position ``p``.
    ``arrival_time``, ``first_scheduled_time`` and ``last_token_time`` are ``time.monotonic()``
    stamps the engine takes for the latency histograms (runtime/latency.py).
    ``num_pending`` tokens (0 or 1 between steps) were sampled on the device and not yet read by
    the host (overlapped steps, see engine.py): they follow ``token_ids`` and the next step may
    already run them.
    ``seed`` is the one source of the sequence's draws: ``params.seed`` when given, else
    ``sampling_params.default_seed`` (the engine sets it at admission). The token at position
    ``p`` is drawn with noise keyed on ``(seed, p)``.
    """

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                 request_id: str | None = None, arrival_time: float | None = None,
                 choice_index: int = 0, seq_id: int | None = None):
        # also the arrival order: FCFS and preemption use it
        self.seq_id = next(_seq_counter) if seq_id is None else seq_id
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params if params is not None else SamplingParams()
        self.seed = self.params.seed if self.params.seed is not None else default_seed(0, self.request_id)
        self.choice_index = choice_index
        self.num_forks = self.params.n - 1 if choice_index == 0 else 0
        self.child_seq_ids = [next(_seq_counter) for _ in range(self.num_forks)]
        self.fork_window_pages: list[int] = []
        self.fork_quant_pages: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.window_pages: list[int] = []
        self.quant_pages: list[int] = []
        self.num_cached_tokens = 0
        self.num_prefix_cached_tokens = 0
        self.history_floor = 0
        self.num_cached_prompt_tokens = 0
        self.block_hashes: list[bytes] = []
        self.num_committed_blocks = 0
        self.staging_pages: list[int] = []
        self.swap: tuple[int, int, int] | None = None
        self.num_pending = 0
        self.num_preemptions = 0
        self.num_swaps = 0  # of num_preemptions: swapped out (the others recomputed)
        # Filled by the engine as tokens are appended; plain Python values only.
        self.output_logprobs: list[Any] = []
        self.output_text = ""
        self.prompt_logprobs: list[Any] = ([None] * self.num_prompt_tokens
                                           if self.params.prompt_logprobs is not None else [])
        self.detokenizer: Any = None
        # time.monotonic() stamps for the latency histograms (runtime/latency.py)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.last_token_time: float | None = None

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, status={self.status.value}, "
                f"tokens={self.num_tokens}, cached={self.num_cached_tokens})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncached_tokens(self) -> int:
        return self.num_tokens + self.num_pending - self.num_cached_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def has_pages(self) -> bool:
        return bool(self.window_pages or self.quant_pages or self.staging_pages
                    or self.fork_window_pages or self.fork_quant_pages)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def is_staged(self) -> bool:
        """Prefilling with deferred demotion: history rows in full-precision staging pages."""
        return bool(self.staging_pages)

    def append_token(self, token_id: int) -> None:
        """Add a sampled token; its K/V enters the cache at the next step."""
        self.token_ids.append(int(token_id))

    def fork(self, index: int) -> Sequence:
        """Choice ``index`` of this request, before its first token: the prompt's tokens and
        state, no pages yet (``PageManager.fork`` gives them)."""
        child = Sequence(self.prompt_token_ids, self.params, self.request_id, self.arrival_time,
                         choice_index=index, seq_id=self.child_seq_ids[index - 1])
        child.seed = self.seed + index  # the sampler takes it mod 2^64
        child.prompt_logprobs = self.prompt_logprobs  # complete once the prompt is in: read only
        child.first_scheduled_time = self.first_scheduled_time
        return child

    def reset_cache_state(self) -> None:
        """Forget everything cached (after preemption): the tokens stay and will be recomputed."""
        self.window_pages = []
        self.quant_pages = []
        self.staging_pages = []
        self.fork_window_pages = []
        self.fork_quant_pages = []
        self.num_cached_tokens = 0
        self.num_prefix_cached_tokens = 0
        self.history_floor = 0
        self.num_committed_blocks = 0
