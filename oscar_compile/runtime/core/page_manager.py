"""Which pages each sequence owns: admission, growth by demotion, release, prefix sharing.

Per docs/cache-format.md, a sequence that has cached L tokens holds
- ``(S0 + W) / P`` window pages, allocated at admission: the sink pages (slots ``[0, S0)``) and
  the recent ring (slots ``[S0, S0 + W)``);
- ``ceil(h / P)`` quant pages for its ``h`` history tokens, positions ``[S0, S0 + h)``. Normally
  ``h = max(0, L - W - S0)``: a new quant page is taken each ``P`` demoted tokens.

Prefix caching. The tokens are cut into blocks of P: block ``k < S0 / P`` is sink page ``k``,
block ``S0 / P + j`` is history page ``j``. A block is *final* once its content can no longer
change (sink block: all its tokens cached; history block: all its tokens demoted); it is then
registered under a hash chained over the ids of its tokens and of all tokens before it, so equal
hashes mean equal prompts up to the block end. Recent-ring pages are never
shared: they are overwritten as the sequence advances.

What a hit means with windows. A new sequence of n tokens reuses the longest run of cached
blocks ``[0, R)`` such that **R <= n - max(W, 1)**: the recomputed tokens ``[R, n)`` cover the
whole recent window ``[n - W, n)`` (its full-precision values cannot be rebuilt from INT-b
history) and at least one token is computed to produce logits. After a hit with R > S0 the
cache holds sink ``[0, S0)``, history ``[S0, R)`` and an *empty* ring: ``history_floor = R - S0``
and ``h = max(history_floor, L - W - S0)``. This state is transient - once the prompt is in, the
state is the standard one (history ``[S0, n - W)``, ring ``[n - W, n)``) - but while it lasts the
ring holds only positions ``>= S0 + h``; the runner receives ``h`` per sequence (``history_lens``)
and must only demote ring tokens that are in the ring. With W = 0 (BF16 mode) a hit is the
classic paged-attention hit and the state is always standard.

The ``oscar::`` ops take that ``h`` as their ``history_lens`` argument (docs/cache-format.md):
``cache_write`` then demotes only ring positions ``>= S0 + h`` and ``attention`` reads history
rows ``[0, h)`` and only the ring slots that hold a token. Called without it, they derive the
standard state from ``cache_lens`` - after such a hit they would demote stale ring slots into
the shared history pages. So history hits with W > 0 are opt-in (``history_hits``, off by
default; ``build_engine`` sets it from the runner's ``capabilities.history_hits``: the compressed
runner passes ``history_lens``); without them a hit also stops at the sink (R <= S0), which is
always a standard state.

Window snapshots (window_snapshots.py; ``snapshots``, set under decode-consistent prefill). A hit
may also end at a page boundary R at which a sequence's ring pages were copied: it shares the
sink and the history ``[S0, R - W)``, and ``allocate`` returns the copy of the snapshot into its
fresh ring pages. The state is then the standard one (``history_floor = 0``), so the hit is exact
(R <= n - 1 only: the ring is restored, not recomputed). Without a snapshot such a hit stops at
the sink. Snapshots are taken inside the step whose chunk passes their boundary
(``plan_snapshots``) or after the one that ends there (``capture_snapshot``); they cut no chunk.

Exactness: equal hashes mean equal tokens, hence equal K/V for an exact runner. With a quantized
cache, a hit past the sink reads the shared history quantized where a miss would attend to those
tokens in full precision (README, "Prefix-cache hits").

Deferred demotion (prompt-exact chunked prefill). ``generate()`` attends over the whole prompt in
full precision and quantizes afterwards; a prompt prefilled in chunks must do the same, or later
chunks would read earlier ones back quantized. A sequence admitted with a prompt (more exactly:
all its known tokens) that does not fit its first chunk is *staged*: it takes, at admission, the
``ceil(h / P)`` full-precision **staging pages** its history ``h`` will need once every known token
is cached, and the runner keeps its history rows there (16-bit rows) while it prefills. Its quant
pages are taken as usual, as the history grows, so the page accounting does not change. At the
step whose chunk reaches the last known token the runner quantizes the staged rows into the quant
pages (the same bulk write ``generate()`` does) and ``end_staging`` frees the staging pages.
Staging pages are reserved whole at admission, so a staged prefill never waits for staging
memory midway (no deadlock between half-staged prompts). Not staged: a prompt that fits one chunk
(exact already), one whose history stays empty, a hit past the sink (its history rows are shared
INT-b pages), the BF16 mode (nothing is quantized), and decode-consistent prefill
(formats/prefill.py: later chunks must read earlier ones quantized, as decode does; the engine
then builds no staging pool).

Swapping. ``swap_out`` moves a preempted sequence's page contents to a range of host swap space
(swap_space.py; the runner copies) and drops its page references, keeping its counters;
``swap_in`` gives it fresh pages and the runner copies the contents back before it runs. A staged
sequence is not swapped (its staging pages are large): it is recomputed, staged again.

Parallel sampling (``SamplingParams.n``). A request of n choices is one sequence (choice 0) until
its prompt is cached; then ``fork`` gives each other choice its own pages, as they were at that
moment: the final sink pages and the full history pages are *shared* (one more reference: their
content never changes again), the rest of the window pages (a partial sink page, the recent
ring) and the partial last history page, which every choice demotes its own tokens into, are
*copied* into fresh pages (``PageCopy``: the runner copies them on the device before the next
forward). So every choice reads the prompt exactly as the request alone would, and the prompt's
full pages are held once. A prefix-cache hit is no substitute: ring pages are never shared, and
a hit reads the prefix back quantized where the prefill attended to it in full precision. The
copies' pages are taken at admission (``fork_need``), so a fork never waits for memory; a
sequence that has yet to fork is recomputed if preempted, never swapped (its reserved pages
hold nothing). A forked choice is an ordinary sequence: swapped out, it takes its shared pages
along as private copies; recomputed, it may hit the prompt's pages in the prefix cache.
"""

from __future__ import annotations

import hashlib
from array import array

from oscar_compile.formats.cache import CacheLayout
from oscar_compile.runtime.core.page_pool import PagePool
from oscar_compile.runtime.core.page_records import PageCopy, PrefixMatch, SnapshotTake, SwapCopy
from oscar_compile.runtime.core.sequence import Sequence
from oscar_compile.runtime.core.swap_space import SwapSpace
from oscar_compile.runtime.core.window_snapshots import WindowSnapshots

_ROOT_HASH = b""


def hash_block(prev_hash: bytes, token_ids) -> bytes:
    """128-bit chained hash of one block: collisions are negligible, so no token compare."""
    digest = hashlib.blake2b(prev_hash, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class PageManager:
    def __init__(self, layout: CacheLayout, num_window_pages: int, num_quant_pages: int,
                 enable_prefix_caching: bool = True, history_hits: bool = False,
                 num_staging_pages: int = 0, swap_space: SwapSpace | None = None,
                 snapshot_interval: int | None = None, deterministic: bool = False):
        """``snapshot_interval``: take window snapshots that many tokens apart (module docstring;
        None: none); ``deterministic``: ``make_deterministic`` at once."""
        self.layout = layout
        self.history_hits = history_hits
        self.window_pool = PagePool("window", num_window_pages)
        self.snapshots: WindowSnapshots | None = (  # window snapshots (module docstring)
            None if snapshot_interval is None else WindowSnapshots(layout, self.window_pool, snapshot_interval))
        self.quant_pool = PagePool("quant", num_quant_pages)
        # no staging in the BF16 mode: nothing is ever quantized
        self.staging_pool = PagePool("staging", 0 if layout.is_full_precision else num_staging_pages)
        self.swap_space = swap_space
        self.peak_staging_pages = 0
        self.num_staged_prefills = 0
        self.enable_prefix_caching = enable_prefix_caching
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0
        # pages the choices of forked requests took: shared by reference, or copied (by kind)
        self.num_fork_pages_shared = {"window": 0, "quant": 0}
        self.num_fork_pages_copied = {"window": 0, "quant": 0}
        self.deterministic = False  # one-token calls only where every run makes them (make_deterministic)
        if deterministic:
            self.make_deterministic()

    # ---- sizes -------------------------------------------------------------------------------
    def history_len(self, seq: Sequence, num_cached_tokens: int | None = None) -> int:
        """History tokens ``h`` held when ``num_cached_tokens`` (default: now) are cached."""
        L = seq.num_cached_tokens if num_cached_tokens is None else num_cached_tokens
        return self.layout.num_history_tokens(L, seq.history_floor)

    def max_seq_len(self, num_choices: int = 1, num_prompt_tokens: int = 0) -> int:
        """The longest sequence the pools can hold on their own (0 if its windows do not fit); with
        ``num_choices``, the longest each choice of a request of ``num_prompt_tokens`` can reach
        (its prompt's shared pages counted once, the rest ``num_choices`` times)."""
        layout = self.layout
        shared_window, shared_quant, _ = self._fork_split(num_prompt_tokens) if num_choices > 1 else (0, 0, 0)
        per_choice = layout.num_window_pages_per_seq - shared_window
        if shared_window + num_choices * per_choice > self.window_pool.num_pages:
            return 0
        num_quant = shared_quant + (self.quant_pool.num_pages - shared_quant) // num_choices
        return num_quant * layout.page_size + layout.sink + layout.recent

    def can_ever_fit(self, num_tokens: int, num_choices: int = 1, num_prompt_tokens: int = 0) -> bool:
        """Whether a request of ``num_tokens`` (each of its choices) fits the pools on its own
        (else it never runs)."""
        return num_tokens <= self.max_seq_len(num_choices, num_prompt_tokens)

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hit_tokens / max(self.num_prefix_queried_tokens, 1)

    # ---- admission ---------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Longest reusable cached prefix of ``seq`` under the window rule (module docstring).
        No match for a sequence that wants prompt logprobs: it needs the logits of every prompt
        position, so it is prefilled from position 0 (as vLLM does)."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return PrefixMatch()
        self._update_hashes(seq)
        limit = max(seq.num_tokens - max(self.layout.recent, 1), 0)
        if self.snapshots is not None:
            match = self.snapshots.match(seq, *self._cached_run(seq, seq.num_tokens - 1))
            if match is not None:
                return match
        if not self.history_hits and self.layout.recent > 0:
            limit = min(limit, self.layout.sink)
        window, quant = self._cached_run(seq, limit)
        R = len(window + quant) * self.layout.page_size
        if self.deterministic and R and seq.num_prompt_tokens - R == 1:
            (quant or window).pop()  # make_deterministic: the hit leaves 2 prompt tokens or none
        return PrefixMatch((len(window) + len(quant)) * self.layout.page_size, tuple(window), tuple(quant))

    def _cached_run(self, seq: Sequence, limit: int) -> tuple[list[int], list[int]]:
        """(sink pages, history pages) of the longest run of cached blocks within ``[0, limit)``."""
        num_sink = self.layout.num_sink_pages
        window: list[int] = []
        quant: list[int] = []
        for k in range(min(limit // self.layout.page_size, len(seq.block_hashes))):
            is_sink = k < num_sink
            page = (self.window_pool if is_sink else self.quant_pool).lookup(seq.block_hashes[k])
            if page is None:
                break
            (window if is_sink else quant).append(page)
        return window, quant

    def staging_need(self, seq: Sequence, match: PrefixMatch, num_new_tokens: int) -> int:
        """Staging pages ``seq`` takes if admitted with ``match`` and a first chunk of
        ``num_new_tokens`` (0: not staged; the module docstring says when)."""
        if not self.staging_pool.num_pages or match.num_tokens > self.layout.sink:
            return 0
        if match.num_tokens + num_new_tokens >= seq.num_tokens:
            return 0
        return self.layout.num_quant_pages_for(self.layout.num_history_tokens(seq.num_tokens))

    def can_ever_stage(self, num_tokens: int) -> bool:
        """Whether the staging pool can hold the history of a prompt of ``num_tokens`` alone."""
        need = self.layout.num_quant_pages_for(self.layout.num_history_tokens(num_tokens))
        return need <= self.staging_pool.num_pages

    def can_allocate(self, seq: Sequence, match: PrefixMatch, num_new_tokens: int,
                     num_staging: int = 0) -> bool:
        """Room to admit ``seq`` with ``match`` and to cache its first ``num_new_tokens``
        (and ``num_staging`` staging pages)."""
        num_window = self.layout.num_window_pages_per_seq - len(match.window_pages)
        history = self.layout.num_history_tokens(match.num_tokens + num_new_tokens, self._history_floor(match))
        num_quant = self.layout.num_quant_pages_for(history) - len(match.quant_pages)
        fork_window, fork_quant = self.fork_need(seq)
        held = match.window_pages + match.snapshot_pages
        return (num_window + fork_window <= self._num_available(self.window_pool, held)
                and num_quant + fork_quant <= self._num_available(self.quant_pool, match.quant_pages)
                and num_staging <= self.staging_pool.num_available)

    def allocate(self, seq: Sequence, match: PrefixMatch, num_staging: int = 0) -> PageCopy | None:
        """Give ``seq`` its window pages and the matched prefix; its cache then holds R tokens.
        Returns the copy of a matched window snapshot into its ring, which the runner makes
        before the step's swaps and forward (the only writers of pages taken after it)."""
        if seq.has_pages:
            raise RuntimeError(f"{seq} already has pages")
        # Take the references first so fresh allocations cannot evict the matched pages.
        for page in match.window_pages + match.snapshot_pages:
            self.window_pool.acquire(page)
        for page in match.quant_pages:
            self.quant_pool.acquire(page)
        num_fresh = self.layout.num_window_pages_per_seq - len(match.window_pages)
        seq.window_pages = list(match.window_pages) + [self.window_pool.allocate() for _ in range(num_fresh)]
        seq.quant_pages = list(match.quant_pages)
        seq.num_cached_tokens = seq.num_prefix_cached_tokens = match.num_tokens
        seq.history_floor = self._history_floor(match)
        seq.num_cached_prompt_tokens = min(match.num_tokens, seq.num_prompt_tokens)
        seq.num_committed_blocks = len(match.window_pages) + len(match.quant_pages)
        seq.staging_pages = [self.staging_pool.allocate() for _ in range(num_staging)]
        fork_window, fork_quant = self.fork_need(seq)
        seq.fork_window_pages = [self.window_pool.allocate() for _ in range(fork_window)]
        seq.fork_quant_pages = [self.quant_pool.allocate() for _ in range(fork_quant)]
        if num_staging:
            self.num_staged_prefills += 1
            self.peak_staging_pages = max(self.peak_staging_pages, self.staging_pool.num_used)
        if self.enable_prefix_caching:
            self.num_prefix_queried_tokens += seq.num_tokens
            self.num_prefix_hit_tokens += match.num_tokens
        if not match.snapshot_pages:
            return None
        for page in match.snapshot_pages:  # back to the cache, as recently used
            self.window_pool.release(page)
        return self.snapshots.restore(match.snapshot_pages, seq.window_pages[len(match.window_pages):])

    # ---- growth ------------------------------------------------------------------------------
    def _num_quant_pages_missing(self, seq: Sequence, num_new_tokens: int) -> int:
        history = self.history_len(seq, seq.num_cached_tokens + num_new_tokens)
        return self.layout.num_quant_pages_for(history) - len(seq.quant_pages)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._num_quant_pages_missing(seq, num_new_tokens) <= self.quant_pool.num_available

    def may_append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Take the quant pages that writing ``num_new_tokens`` more tokens will demote into."""
        for _ in range(self._num_quant_pages_missing(seq, num_new_tokens)):
            seq.quant_pages.append(self.quant_pool.allocate())

    def commit(self, seq: Sequence) -> None:
        """Register blocks that became final; call after ``num_cached_tokens`` advanced."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(seq)
        num_final = min(self._num_final_blocks(seq), len(seq.block_hashes))
        num_sink = self.layout.num_sink_pages
        for k in range(seq.num_committed_blocks, num_final):
            if k < num_sink:
                self.window_pool.register(seq.window_pages[k], seq.block_hashes[k])
            else:
                self.quant_pool.register(seq.quant_pages[k - num_sink], seq.block_hashes[k])
        seq.num_committed_blocks = max(seq.num_committed_blocks, num_final)

    def cut_chunk(self, seq: Sequence, num_cached: int, num_new: int) -> int:
        """``num_new`` tokens after ``num_cached``: the budget's cut, and in deterministic mode
        :meth:`make_deterministic`'s rules (0: none this step). Window snapshots cut nothing (a
        chunk that passes a boundary takes its snapshot inside its step: :meth:`plan_snapshots`)."""
        if not self.deterministic:
            return num_new
        prompt = seq.num_prompt_tokens
        if num_cached >= prompt:
            return min(num_new, 1)  # generated tokens, recomputed: one per step, as they were decoded
        whole = prompt - num_cached  # the chunk the budget does not cut
        n = min(num_new, whole)
        if n < whole and whole - n == 1:
            n -= 1
        return 0 if n == 1 < whole else n

    def make_deterministic(self) -> None:
        """Deterministic mode (``RunnerConfig.deterministic``). The prefill kernels'
        rows do not depend on their chunk, but a one-token call runs the decode kernels (the
        CUDA-graph path), whose rounding differs. So a position is computed by a one-token call in
        every run or in none: a prompt of n >= 2 tokens is cut into chunks of at least 2 tokens,
        whatever the budget, a hit (and so a snapshot boundary) leaves at least 2 of its tokens, and the
        generated tokens of a recomputed sequence are fed one per step, as they were decoded. The
        budget (``max_num_batched_tokens``) must be at least 3."""
        self.deterministic = True
        if self.snapshots is not None:
            self.snapshots.min_tail = 2

    def plan_snapshots(self, seq: Sequence, num_new_tokens: int) -> list[SnapshotTake]:
        """The window snapshots ``seq``'s chunk of ``num_new_tokens`` takes inside its step, once
        the step's admissions are done (window_snapshots.py, "Boundaries")."""
        if self.snapshots is None or num_new_tokens < 2:
            return []
        self._update_hashes(seq)
        return self.snapshots.plan(seq, num_new_tokens)

    def capture_snapshot(self, seq: Sequence) -> PageCopy | None:
        """After ``advance``: the copy of ``seq``'s ring into the snapshot at its cached length,
        if one is taken there (window_snapshots.py)."""
        return None if self.snapshots is None else self.snapshots.capture(seq, self.history_len(seq))

    def end_staging(self, seq: Sequence) -> None:
        """The runner has quantized the staged history (every known token is cached): free the
        staging pages."""
        for page in seq.staging_pages:
            self.staging_pool.release(page)
        seq.staging_pages = []

    # ---- release -----------------------------------------------------------------------------
    def deallocate(self, seq: Sequence) -> None:
        """Drop every page reference of ``seq`` (finish, abort or preemption to recompute)."""
        self._release_pages(seq)
        if seq.swap is not None:  # ended while swapped out
            self.swap_space.free(seq.swap[0])
            seq.swap = None
        seq.reset_cache_state()

    def _release_pages(self, seq: Sequence) -> None:
        """Later blocks are released first so they sit ahead of their prefixes in the eviction
        order: a chain loses its tail before its head."""
        for page in reversed(seq.quant_pages):
            self.quant_pool.release(page)
        for page in reversed(seq.window_pages):
            self.window_pool.release(page)
        for pool, pages in ((self.window_pool, seq.fork_window_pages), (self.quant_pool, seq.fork_quant_pages)):
            for page in pages:
                pool.release(page)
        self.end_staging(seq)
        seq.window_pages, seq.quant_pages = [], []
        seq.fork_window_pages, seq.fork_quant_pages = [], []

    # ---- swapping ----------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        """Host room for ``seq``'s pages (staged or empty sequences are recomputed instead)."""
        return (self.swap_space is not None and not seq.is_staged and not seq.num_forks and seq.num_cached_tokens > 0
                and self.swap_space.can_fit(len(seq.window_pages), len(seq.quant_pages)))

    def swap_out(self, seq: Sequence) -> SwapCopy:
        """Reserve host room for ``seq``'s pages and drop its device pages (their content is
        copied out by the runner before this step's forward can overwrite them)."""
        offset = self.swap_space.allocate(len(seq.window_pages), len(seq.quant_pages))
        copy = SwapCopy(offset, tuple(seq.window_pages), tuple(seq.quant_pages))
        seq.swap = (offset, len(seq.window_pages), len(seq.quant_pages))
        self._release_pages(seq)
        return copy

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        _, num_window, num_quant = seq.swap
        history = self.history_len(seq, seq.num_cached_tokens + num_new_tokens)
        num_quant = max(num_quant, self.layout.num_quant_pages_for(history))
        return num_window <= self.window_pool.num_available and num_quant <= self.quant_pool.num_available

    def swap_in(self, seq: Sequence) -> SwapCopy:
        """Fresh device pages for a swapped-out ``seq``; the runner copies its content back."""
        offset, num_window, num_quant = seq.swap
        seq.window_pages = [self.window_pool.allocate() for _ in range(num_window)]
        seq.quant_pages = [self.quant_pool.allocate() for _ in range(num_quant)]
        self.swap_space.free(offset)  # the copy back is queued before any later copy reuses it
        self.swap_space.num_swapped_in += 1
        seq.swap = None
        return SwapCopy(offset, tuple(seq.window_pages), tuple(seq.quant_pages))

    # ---- parallel sampling -------------------------------------------------------------------
    def _fork_split(self, num_cached_tokens: int) -> tuple[int, int, int]:
        """(shared window pages, shared quant pages, quant pages) of a sequence forked with
        ``num_cached_tokens`` cached in the standard state: its final sink pages and full history
        pages are shared."""
        layout = self.layout
        history = layout.num_history_tokens(num_cached_tokens)
        shared_window = min(num_cached_tokens // layout.page_size, layout.num_sink_pages)
        return shared_window, history // layout.page_size, layout.num_quant_pages_for(history)

    def fork_need(self, seq: Sequence) -> tuple[int, int]:
        """(window, quant) pages the other choices of ``seq`` take when it forks, once its prompt
        is cached; (0, 0) for a sequence that does not fork (any more)."""
        if not seq.num_forks:
            return 0, 0
        shared_window, shared_quant, num_quant = self._fork_split(seq.num_prompt_tokens)
        return (seq.num_forks * (self.layout.num_window_pages_per_seq - shared_window),
                seq.num_forks * (num_quant - shared_quant))

    def fork(self, parent: Sequence, children: list[Sequence]) -> PageCopy:
        """Pages for the choices ``children`` of ``parent``, whose prompt is cached and which has
        generated nothing (module docstring, "Parallel sampling"): shared pages get a reference,
        the others are copied into the pages reserved at admission."""
        shared_window, shared_quant, num_quant = self._fork_split(parent.num_cached_tokens)
        num_window = len(parent.window_pages) - shared_window
        if (parent.is_staged or parent.num_cached_tokens != parent.num_prompt_tokens
                or len(children) != parent.num_forks or len(parent.quant_pages) != num_quant
                or len(parent.fork_window_pages) != len(children) * num_window
                or len(parent.fork_quant_pages) != len(children) * (num_quant - shared_quant)):
            raise RuntimeError(f"{parent} cannot fork {len(children)} choices in this state")
        window_src: list[int] = []
        window_dst: list[int] = []
        quant_src: list[int] = []
        quant_dst: list[int] = []
        for child in children:
            child.window_pages = _fork_table(self.window_pool, parent.window_pages, shared_window,
                                             parent.fork_window_pages, window_src, window_dst)
            child.quant_pages = _fork_table(self.quant_pool, parent.quant_pages, shared_quant,
                                            parent.fork_quant_pages, quant_src, quant_dst)
            child.num_cached_tokens = parent.num_cached_tokens
            child.num_prefix_cached_tokens = parent.num_prefix_cached_tokens
            child.history_floor = parent.history_floor
            child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
            child.block_hashes = list(parent.block_hashes)
            child.num_committed_blocks = parent.num_committed_blocks
        parent.num_forks = 0
        for kind, shared, copied in (("window", shared_window, window_dst), ("quant", shared_quant, quant_dst)):
            self.num_fork_pages_shared[kind] += shared * len(children)
            self.num_fork_pages_copied[kind] += len(copied)
        return PageCopy(tuple(window_src), tuple(window_dst), tuple(quant_src), tuple(quant_dst))

    # ---- helpers -----------------------------------------------------------------------------
    def _update_hashes(self, seq: Sequence) -> None:
        P = self.layout.page_size
        hashes = seq.block_hashes
        for k in range(len(hashes), seq.num_tokens // P):
            prev = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash_block(prev, seq.token_ids[k * P:(k + 1) * P]))

    def _num_final_blocks(self, seq: Sequence) -> int:
        P, sink = self.layout.page_size, self.layout.sink
        if seq.num_cached_tokens < sink:
            return seq.num_cached_tokens // P
        return self.layout.num_sink_pages + self.history_len(seq) // P

    def _history_floor(self, match: PrefixMatch) -> int:
        """The history a sequence admitted with ``match`` keeps while its ring refills (module
        docstring): none after a snapshot, whose ring is restored."""
        return 0 if match.snapshot_pages else max(0, match.num_tokens - self.layout.sink)

    @staticmethod
    def _num_available(pool: PagePool, matched: tuple[int, ...]) -> int:
        """Available pages once the matched ones (maybe sitting in the eviction list) are taken."""
        return pool.num_available - sum(1 for page in matched if pool.is_cached_unused(page))


def _fork_table(pool: PagePool, table: list[int], num_shared: int, reserved: list[int],
                src: list[int], dst: list[int]) -> list[int]:
    """A choice's copy of ``table``: its first ``num_shared`` pages shared (one more reference),
    each other one copied into a page taken from ``reserved`` (the pair appended to src / dst)."""
    for page in table[:num_shared]:
        pool.acquire(page)
    copies = [reserved.pop() for _ in table[num_shared:]]
    src += table[num_shared:]
    dst += copies
    return table[:num_shared] + copies
