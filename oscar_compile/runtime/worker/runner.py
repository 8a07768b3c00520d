"""What the engine hands a model runner each step, the runner protocol, and the exact fallback.

A runner gets a ``Batch`` of plain Python lists and builds whatever tensors it needs; it returns
the next-token logits of the *last* new token of every sequence, ``[num_seqs, vocab]``. Rows of
sequences still mid-prefill are ignored by the engine (computing them is harmless).

The compressed runner (the ``oscar::`` ops over the paged INT2 cache) implements the same
protocol; ``RecomputeRunner`` is the reference: no cache at all, the plain Hugging Face model
over each sequence's whole context every step. Exact and slow - for tests, tiny models on CPU and
as the fallback when no compressed runner is available.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from oscar_compile.formats.cache import CacheLayout
from oscar_compile.kernels.determinism import deterministic as deterministic_mode
from oscar_compile.runtime.core.config import RunnerCapabilities
from oscar_compile.runtime.core.page_manager import PageManager
from oscar_compile.runtime.core.page_records import SnapshotTake


@dataclass(frozen=True)
class Batch:
    """One step of work. Index ``i`` is a sequence; new tokens are flattened in that order.

    - ``token_ids[i]``: the ``T_i`` new tokens to run (prefill chunk, or 1 when decoding);
    - ``positions[i]``: their positions, ``cache_lens[i] .. cache_lens[i] + T_i - 1``;
    - ``cache_lens[i]``: L, tokens already in the cache for sequence i;
    - ``history_lens[i]``: h, history tokens held before the step (positions ``[S0, S0 + h)``);
      the recent ring holds positions ``[S0 + h, L)`` (when ``L > S0``). Equals ``max(0, L - W - S0)`` except right
      after a prefix-cache hit, when the ring starts empty (see page_manager);
    - ``window_tables[i]``: ``(S0 + W) / P`` window page ids (sink pages, then the ring);
    - ``quant_tables[i]``: quant page ids, already long enough for the history after the step;
    - ``context_token_ids[i]``: the sequence's full token list, read-only; the first
      ``cache_lens[i] + T_i`` entries are its context (runners without a cache use it).
      Tables and token lists are the engine's own lists: never modify them; a runner may keep a
      reference to recognise a table it has seen (the compressed runner's mirrors do);
    - ``seq_ids[i]``: stable id of the sequence (for runner-side state keyed per sequence);
    - ``pending_rows`` / ``pending_src``: sequences ``pending_rows[j]`` run one token that the
      previous step sampled and the host has not read yet: ``token_ids`` holds a placeholder and
      the runner takes the token from row ``pending_src[j]`` of that step's sampled ids (its
      ``run(batch, pending_tokens)``). Only runners with ``capabilities.pending_tokens`` get them.
    - ``staging_tables[i]``: staging page ids of a staged sequence (page_manager, "Deferred
      demotion"), ``[]`` for the others; the whole field is ``()`` when no row is staged. A staged
      row keeps its history rows in full precision in those pages (its quant table is allocated
      alongside); ``staging_ends`` lists the rows whose chunk caches their last known token: after
      writing it the runner quantizes the staged history into the quant pages. A runner without
      ``capabilities.staging`` never gets staged rows (it need not look at these fields).
    - ``logit_rows``: rows whose every new token's logits the runner returns too, after the
      ``num_seqs`` last-token rows, row by row in this order (``logit_row_offsets``). Only runners
      with ``capabilities.prompt_logits`` get them.
    - ``snapshot_takes``: ``(row, SnapshotTake)`` pairs, the window snapshots row's chunk takes
      inside the step (core/window_snapshots.py, "Boundaries"): in every layer, before its cache
      write, the runner writes the ring pages as they are at the take's boundary into the take's
      pages (``worker/snapshot_takes.py``). Only runners with ``capabilities.page_copies`` get
      them (a runner that keeps no page content has nothing to take).
    """

    seq_ids: list[int]
    token_ids: list[list[int]]
    positions: list[list[int]]
    cache_lens: list[int]
    history_lens: list[int]
    window_tables: list[list[int]]
    quant_tables: list[list[int]]
    context_token_ids: list[Seq[int]]
    layout: CacheLayout
    pending_rows: tuple[int, ...] = ()
    pending_src: tuple[int, ...] = ()
    staging_tables: tuple[Seq[int], ...] = ()
    staging_ends: tuple[int, ...] = ()
    logit_rows: tuple[int, ...] = ()
    snapshot_takes: tuple[tuple[int, SnapshotTake], ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)

    def cu_seqlens(self) -> list[int]:
        """[num_seqs + 1] offsets of each sequence's new tokens in the flattened order."""
        offsets = [0]
        for ids in self.token_ids:
            offsets.append(offsets[-1] + len(ids))
        return offsets

    def logit_row_positions(self) -> list[int]:
        """Indices, in the flattened new tokens, of the ``logit_rows``' tokens, in order."""
        cu = self.cu_seqlens()
        return [t for i in self.logit_rows for t in range(cu[i], cu[i + 1])]


@runtime_checkable
class ModelRunner(Protocol):
    """Runs one step. ``run`` must cache the batch's new tokens (K/V written into the pages)
    and return float logits ``[num_seqs, vocab]`` for each sequence's last new token (followed by
    every new token of ``Batch.logit_rows`` when ``capabilities.prompt_logits``).

    ``capabilities`` (core/config.py) says what else it does, and so which of these it has:
    ``run(batch, pending_tokens)`` (``pending_tokens``); ``swap(swap_out, swap_in)`` (lists of
    ``page_manager.SwapCopy``: page contents to host swap space and back, queued before the next
    ``run``; ``swapping``); ``copy_pages(copy)`` (a ``page_manager.PageCopy``: page contents into
    fresh pages for forked choices and window snapshots, queued before the next ``run``;
    ``page_copies``).
    """

    vocab_size: int
    capabilities: RunnerCapabilities

    def run(self, batch: Batch) -> torch.Tensor: ...


@dataclass(frozen=True)
class RunnerFactory:
    """A runner that is built after the page manager, from its page counts (the compressed
    runner allocates its pools from them), with the ``capabilities`` the page manager is built
    for. ``build_engine`` checks that the runner built has them.

    ``profile``: where one device's profile run is not enough, the memory profiles
    (``core.memory_plan.MemoryProfile``) of every device of the runner, each measured by a
    runner built over the page manager given (one sequence's pages) running the step of the
    rows given (``core.memory_plan.largest_step``): the tensor-parallel ranks, in lockstep.
    None: ``build_engine`` builds one and measures it (worker/memory_profile.py)."""

    capabilities: RunnerCapabilities
    build: Callable[[PageManager], ModelRunner]
    profile: Callable[[PageManager, list], list] | None = None

    def __call__(self, page_manager: PageManager) -> ModelRunner:
        return self.build(page_manager)


class RecomputeRunner:
    """Exact runner without a KV cache: one full forward per sequence per step.

    Cost is O(context) per token, so use it for tiny models, tests and the CPU fallback. The
    pages in the batch are ignored: the scheduler's bookkeeping still runs (and is exercised).
    """

    # no cache: any hit state is fine, and a page copy has nothing to copy
    capabilities = RunnerCapabilities(history_hits=True, prompt_logits=True, page_copies=True)

    def __init__(self, model: torch.nn.Module, device: torch.device | str | None = None, deterministic: bool = False):
        self.model = model.eval()
        self.deterministic = deterministic
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size = config.vocab_size

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        rows, every = [], {}
        for i in range(batch.num_seqs):
            num_new = len(batch.token_ids[i])
            num_context = batch.cache_lens[i] + num_new
            ids = torch.tensor([list(batch.context_token_ids[i][:num_context])], device=self.device)
            # logits_to_keep: only the last position's logits are materialized (a logit row's: all new ones)
            keep = num_new if i in batch.logit_rows else 1
            with deterministic_mode() if self.deterministic else contextlib.nullcontext():
                logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits[0].float()
            rows.append(logits[-1])
            every[i] = logits
        return torch.cat([torch.stack(rows)] + [every[i] for i in batch.logit_rows])

    def copy_pages(self, copy) -> None:
        """Forked choices (``n`` > 1): this runner keeps no page content, so nothing to copy."""
