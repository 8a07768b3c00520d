"""The model runner for a model rewritten by ``oscar_compile.apply``: the ``oscar::`` ops over the runtime's pages.

Each step packs every sequence's new tokens into one row ``[1, N]`` with their positions, and
runs the rewritten model with a :class:`StepCache`: the graphs ask it for their op inputs
(``oscar_layer_inputs``) and it answers with the flattened tokens, the batch's ``cu_seqlens``,
``cache_lens`` and page tables, and the layer's pools. Layers use the window ring + history pages,
the history INT-b or, for a layer kept at 16 bits beside INT-b ones, 16-bit rows (same page ids,
a bigger pool row); in the BF16 mode (nothing quantized: no windows) the runtime's quant pages
hold full-precision rows and the quant table is a plain page table (``oscar::attention_bf16``).
On CUDA the ops run the Triton kernels, on CPU their references; decode steps replay CUDA
graphs (:mod:`oscar_compile.runtime.worker.cuda_graphs`).

Every pool has one extra *scratch* page (the last id) that no sequence owns: the padding rows of
a graph replay write and read only there, and so do the prefill-shaped steps that compile the
kernels' variants when the runner starts on a GPU. Hugging Face's mask construction is skipped during
the forward (the rewritten layers never read a mask; the ops mask causally themselves), which
also keeps host syncs out of captured graphs.
"""
from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from oscar_compile.cache.decode_consistent import split_rows
from oscar_compile.cache.op_constants import OpConstants
from oscar_compile.formats.cache import CacheLayout
from oscar_compile.formats.prefill import DECODE_CONSISTENT, DEFAULT_PREFILL_SEMANTICS, check_prefill_semantics
from oscar_compile.kernels.attention.attention_dispatch import AttentionDispatch
from oscar_compile.kernels.determinism import deterministic as deterministic_mode
from oscar_compile.kernels.pools import allocate_layer_pools
from oscar_compile.runtime.core.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PIECEWISE_MAX_TOKENS,
    RunnerCapabilities,
)
from oscar_compile.runtime.worker.runner import Batch, RunnerFactory
from oscar_compile.runtime.worker.snapshot_takes import StepSnapshotTakes
from oscar_compile.runtime.worker.staging import StagedStep, allocate_staging_pools
from oscar_compile.runtime.worker.step_cache import StepCache
from oscar_compile.runtime.worker.step_inputs import StepInputs
from oscar_compile.runtime.worker.swapper import HostSwap
from oscar_compile.runtime.worker.transfer import to_device

# an attention implementation name with no registered mask function: create_causal_mask returns None
_NO_MASK_IMPLEMENTATION = "oscar_paged"


class Rewritten(Protocol):
    """What the runner takes of the handle ``apply`` returns (``passes.CompressedModel``; the runtime
    does not import the passes): the rewritten model, and the constants its graphs pass the INT-b
    ops, which staged rows and decode-consistent prefill pass alike."""

    model: torch.nn.Module
    constants: Mapping[int, OpConstants]
    attention_cores: Mapping[int, Callable]


class CompressedRunner:
    """Runs ``compressed.model`` (rewritten by ``apply``, which returned ``compressed``) over the
    engine's page tables.

    ``max_seq_len`` bounds one sequence (it sizes the page-table mirrors); ``max_num_seqs`` and
    ``max_num_batched_tokens`` size the step buffers (they grow if a step needs more).
    ``cuda_graphs``: replay captured graphs for decode steps of up to ``max_graph_batch``
    sequences on CUDA (captured here, once per padded batch size), and piecewise graphs for the
    other steps of up to ``piecewise_max_tokens`` tokens (piecewise_graphs.py; 0: none).
    ``deterministic``: every forward, the graphs' captures included, runs under
    ``kernels.determinism.deterministic()``; its prefill and mixed steps run eagerly.
    """

    @staticmethod
    def capabilities_for(prefill_semantics: str) -> RunnerCapabilities:
        """Everything: history hits (the INT-b ops get ``Batch.history_lens``), pending tokens
        (overlapped steps), staged rows (staging.py), swapping (swapper.py), prompt logits and
        page copies, in the prefill semantics it is built for."""
        return RunnerCapabilities(history_hits=True, pending_tokens=True, staging=True, swapping=True,
                                  prompt_logits=True, page_copies=True,
                                  prefill_semantics=check_prefill_semantics(prefill_semantics))

    def __init__(self, compressed: Rewritten, layout: CacheLayout, num_window_pages: int, num_quant_pages: int,
                 max_seq_len: int | None = None, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, cuda_graphs: bool = True,
                 max_graph_batch: int = DEFAULT_MAX_NUM_SEQS, num_staging_pages: int = 0,
                 swap_bytes: int = 0, deterministic: bool = False,
                 prefill_semantics: str = DEFAULT_PREFILL_SEMANTICS,
                 piecewise_max_tokens: int = DEFAULT_PIECEWISE_MAX_TOKENS):
        model = self.model = compressed.model
        self.constants = compressed.constants
        self.attention_cores = dict(compressed.attention_cores)  # what piecewise graphs run between pieces
        self.layout = layout
        self.deterministic = deterministic
        self.attention = AttentionDispatch()  # the kernel choice: OSCAR_ATTENTION_KERNEL read once, here
        # transformers renamed the forward's past_key_values to cache (5.2x): look it up once, not per step
        parameters = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
        self.keeps_logit_rows = "logits_to_keep" in parameters  # a 1-D index tensor selects positions
        self.num_layers = layout.num_layers
        self.vocab_size = model.config.get_text_config().vocab_size
        param = next(model.parameters())
        self.device, dtype = param.device, param.dtype
        num_window_pages, num_quant_pages = max(1, num_window_pages), max(1, num_quant_pages)
        self.scratch_window, self.scratch_quant = num_window_pages, num_quant_pages  # the extra last pages
        self.pools = [self._layer_pools(layout, i, num_window_pages + 1, num_quant_pages + 1, dtype)
                      for i in range(self.num_layers)]
        self._init_staging(layout, num_staging_pages, dtype)
        self.prefill_semantics = check_prefill_semantics(prefill_semantics)
        self.capabilities = self.capabilities_for(prefill_semantics)
        # layer -> OpConstants under decode-consistent prefill (cache/decode_consistent.py), else None
        self.decode_consistent = None
        if prefill_semantics == DECODE_CONSISTENT and not layout.is_full_precision:
            if num_staging_pages:
                raise ValueError("decode-consistent prefill stages nothing: build the runner without staging pages")
            self.decode_consistent = self.constants
        self.swapper = self._host_swap(layout, swap_bytes) if swap_bytes else None
        longest = max_seq_len if max_seq_len is not None else num_quant_pages * layout.page_size
        self.quant_width = min(num_quant_pages, math.ceil(longest / layout.page_size))
        self.inputs = self._step_inputs(max_num_seqs, max_num_batched_tokens)
        # benchmarks set a CUDA event here: recorded where a step's forward is queued, after its
        # inputs were packed (bench/e2e.py times the device work of steps with it, syncing nothing)
        self.forward_started: torch.cuda.Event | None = None
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda":
            from oscar_compile.runtime.worker.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, min(max_graph_batch, max_num_seqs))
            self.graphs.capture_all(layout)
        self.piecewise = None
        if cuda_graphs and self.device.type == "cuda" and piecewise_max_tokens > 0 and not deterministic:
            from oscar_compile.runtime.worker.piecewise_graphs import PiecewiseGraphs

            self.piecewise = PiecewiseGraphs(self, piecewise_max_tokens, max_num_seqs)
            self.piecewise.capture_all()
        if self.device.type == "cuda":
            self._compile_prefill_kernels(layout)

    def _layer_pools(self, layout: CacheLayout, layer: int, num_window: int, num_quant: int, dtype) -> tuple:
        fmt = layout.format_of(layer)
        H, P, D = layout.num_kv_heads, fmt.page_size, layout.head_dim
        if fmt.full_precision_pages:
            pages = torch.zeros(num_quant, H, P, D, dtype=dtype, device=self.device)
            return pages, torch.zeros_like(pages)
        return tuple(allocate_layer_pools(fmt, num_quant, num_window, H, D, dtype, self.device))

    def _init_staging(self, layout: CacheLayout, num_pages: int, dtype) -> None:
        """Staging pools (16-bit history rows, one extra scratch page) for the INT-b layers."""
        self.scratch_staging = num_pages
        self.staging_pools: list[tuple | None] = [None] * self.num_layers
        self.op_constants = {}
        if not num_pages or layout.is_full_precision:
            return
        self.op_constants = self.constants
        for i in range(self.num_layers):
            if not layout.format_of(i).full_precision_pages:
                if i not in self.op_constants:
                    raise ValueError(f"layer {i}: no oscar::attention / cache_write call found in its graph")
                self.staging_pools[i] = allocate_staging_pools(layout, num_pages + 1, dtype, self.device)

    def _pool_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every pool tensor indexed by window page id, and every one indexed by quant page id."""
        window, quant = [], []
        for i, pools in enumerate(self.pools):
            if self.layout.format_of(i).full_precision_pages:
                quant += pools
            else:
                window += pools[:2]
                quant += pools[2:]
        return window, quant

    def copy_pages(self, copy) -> None:
        """Copy pages for forked choices (page_manager.PageCopy), queued before the next run on
        the compute stream, after the forward that filled the sources."""
        for tensors, src, dst in zip(self._pool_tensors(), (copy.window_src, copy.quant_src),
                                     (copy.window_dst, copy.quant_dst), strict=True):
            if not src:
                continue
            src_ids, dst_ids = (to_device(list(ids), torch.int64, self.device) for ids in (src, dst))
            for tensor in tensors:
                tensor.index_copy_(0, dst_ids, tensor.index_select(0, src_ids))

    def _host_swap(self, layout: CacheLayout, num_bytes: int) -> HostSwap:
        window, quant = self._pool_tensors()
        swapper = HostSwap(num_bytes, window, quant, self.device)
        has_windows = layout.num_window_pages_per_seq > 0  # else no window page is ever swapped
        if swapper.quant_page_bytes != layout.quant_page_bytes or (
                has_windows and swapper.window_page_bytes != layout.window_page_bytes):
            raise ValueError(f"pool pages of {swapper.window_page_bytes} / {swapper.quant_page_bytes} bytes do "
                             f"not match the layout's {layout.window_page_bytes} / {layout.quant_page_bytes}")
        return swapper

    def swap(self, swap_out: list, swap_in: list) -> None:
        """Copy pages to host swap space and back (page_manager.SwapCopy lists), before the next run."""
        if self.swapper is None:
            raise RuntimeError("this runner was built without swap space")
        self.swapper.swap(swap_out, swap_in)

    @torch.no_grad()
    def _compile_prefill_kernels(self, layout: CacheLayout) -> None:
        """Run the step shapes the decode graphs do not cover on the scratch pages now, so that
        Triton compiles the variants they need here and not in the middle of a running batch
        (seconds each: an H200 batch of 16 lost 15 s so; run 14 of
        bench/results/2026-12-02-h200-serve-load logged 16 such compiles, 40 s in all, before
        two-token steps and trimmed tables were added here). The kernels specialize on one
        sequence / a multiple of 16 / other, on decode-like (at most 2 tokens per sequence) or
        prefill-like steps, and plan their launches from the page tables' width, which eager
        steps trim to the batch's longest sequence: each (sequences, tokens) shape runs with
        full-width tables and with tables as wide as its own history (a first chunk's; under
        the extend path's cap, attention_extend_triton). Only scratch pages are written (the
        graphs' padding rows use them too)."""
        budget = self.inputs.max_tokens
        longest = self.quant_width * layout.page_size - 1
        for num_seqs in sorted({1, min(2, self.inputs.max_seqs), min(16, self.inputs.max_seqs)}):
            for chunk in sorted({min(2, longest), min(8, longest), min(2048, (budget - 1) // num_seqs, longest)}):
                if chunk < 2 or num_seqs * chunk + 1 > budget:  # one token each: the graphs' shape
                    continue
                own = _history_pages(layout, chunk + 1)
                for width in sorted({min(own, self.quant_width), self.quant_width}):
                    shapes = [{}]
                    if num_seqs > 1:  # an odd token count, and one chunk beside decode rows
                        shapes += [dict(extra=1), dict(decodes=True)]
                    if self.op_constants:  # staged rows (16-bit history ops): a last chunk (the
                        # bulk W = 0 write), a middle one, and one beside unstaged decode rows
                        shapes += [dict(staged=True), dict(staged=True, ends=False)]
                        shapes += [dict(staged=True, decodes=True)] if num_seqs > 1 else []
                    for shape in shapes:
                        self.run(self._scratch_batch(layout, num_seqs, chunk, quant_width=width, **shape))
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _scratch_batch(self, layout: CacheLayout, num_seqs: int, chunk: int, extra: int = 0,
                       staged: bool = False, quant_width: int | None = None, decodes: bool = False,
                       ends: bool = True) -> Batch:
        """``num_seqs`` new sequences of ``chunk`` tokens (the first ``extra`` more; with
        ``decodes`` the others one token each) whose every page is a scratch page. The quant
        tables have the full width (or ``quant_width``), as a running batch's do: the attention
        kernels plan history splits from it (split and unsplit compile apart; a batch of 16 once
        stalled 3 s on its first mixed step for want of the split variant). ``staged``: the
        chunk rows are staged, and with ``ends`` their chunks end the staging (the bulk write
        runs too, into the scratch pages)."""
        window = layout.num_window_pages_per_seq
        lens = [chunk + extra] + [1 if decodes else chunk] * (num_seqs - 1)
        staging = {}
        if staged:
            rows = [0] if decodes else list(range(num_seqs))
            width = _history_pages(layout, chunk + extra)
            staging = dict(staging_tables=tuple([self.scratch_staging] * width if i in rows else []
                                                for i in range(num_seqs)),
                           staging_ends=tuple(rows) if ends else ())
        return Batch(seq_ids=[-1 - i for i in range(num_seqs)], token_ids=[[0] * n for n in lens],
                     positions=[list(range(n)) for n in lens], cache_lens=[0] * num_seqs,
                     history_lens=[0] * num_seqs,
                     window_tables=[[self.scratch_window] * window for _ in lens],
                     quant_tables=[[self.scratch_quant] * (quant_width or self.quant_width) for _ in lens],
                     context_token_ids=[[0] * n for n in lens], layout=layout, **staging)

    def _step_inputs(self, max_seqs: int, max_tokens: int) -> StepInputs:
        return StepInputs(max_seqs, max_tokens, self.layout.num_window_pages_per_seq, self.quant_width,
                          self.device, self.scratch_window, self.scratch_quant)

    @torch.no_grad()
    def run(self, batch: Batch, pending_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[num_seqs, vocab]`` (then the ``Batch.logit_rows``' every token);
        ``pending_tokens``: see ``Batch.pending_rows``."""
        if self.graphs is not None and not batch.logit_rows and not batch.snapshot_takes and self.graphs.can_run(batch):
            return self.graphs.run(batch, pending_tokens)
        if self.piecewise is not None and self.piecewise.can_run(batch):
            return self.piecewise.run(batch, pending_tokens)
        inputs = self.load_inputs(batch, pending_tokens)
        cache = self.step_cache(batch, inputs)
        self.mark_forward()
        rows = inputs["cu_seqlens"][1:].long() - 1  # each sequence's last new token
        if batch.logit_rows:  # then every new token of the rows that score their prompt, and no other
            every = torch.tensor(batch.logit_row_positions(), dtype=torch.int64)
            rows = torch.cat([rows, every.to(self.device, non_blocking=True)])
        return self.forward(inputs, rows, cache=cache).float()

    def load_inputs(self, batch: Batch, pending_tokens: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The step's input views (StepInputs, tables trimmed to the batch), its buffers grown first
        if the step does not fit them."""
        if not self.inputs.fits(batch):
            self.inputs = self._step_inputs(max(batch.num_seqs, self.inputs.max_seqs),
                                            max(batch.num_tokens, self.inputs.max_tokens))
        return self.inputs.load(batch, pending_tokens=pending_tokens)

    def step_cache(self, batch: Batch | None, inputs: dict[str, torch.Tensor]) -> StepCache:
        """The cache an eager or piecewise step runs on: its staged rows, window snapshots and
        decode-consistent row split, made on the host once for every layer (None: a step of none)."""
        if batch is None:
            return StepCache(self, inputs)
        staged = None
        if batch.staging_tables:
            if not self.op_constants:
                raise RuntimeError("a staged batch reached a runner built without staging pages")
            staged = StagedStep(batch, inputs, self.layout, self.staging_pools, self.op_constants,
                                self.scratch_window, self.scratch_quant, self.scratch_staging)
        takes = StepSnapshotTakes(batch, self.device) if batch.snapshot_takes else None
        parts = None
        if self.decode_consistent is not None and self.device.type == "cuda":
            parts = split_rows([len(ids) for ids in batch.token_ids],
                               lambda values, dtype: to_device(values, dtype, self.device))
        return StepCache(self, inputs, staged, takes=takes, row_parts=parts)

    def empty_step_inputs(self) -> dict[str, torch.Tensor]:
        """The inputs of a step of one sequence with no new token, on the scratch pages (what
        piecewise captures hand the graph's calls: nothing to attend or write)."""
        zeros = torch.zeros(2, dtype=torch.int32, device=self.device)
        window = max(1, self.layout.num_window_pages_per_seq)  # (as StepInputs' table mirrors are)
        return dict(cu_seqlens=zeros, cache_lens=zeros[:1], history_lens=zeros[1:],
                    window_table=torch.full((1, window), self.scratch_window, dtype=torch.int32, device=self.device),
                    quant_table=torch.full((1, 1), self.scratch_quant, dtype=torch.int32, device=self.device))

    def mark_forward(self) -> None:
        if self.forward_started is not None:
            self.forward_started.record()

    def forward(self, inputs: dict[str, torch.Tensor], rows: torch.Tensor | None = None,
                graph_decode: bool = False, cache: StepCache | None = None) -> torch.Tensor:
        """The model over one packed step: logits ``[N, vocab]`` of every new token, or of ``rows``
        only (the LM head of an 8k-token prefill chunk would otherwise make 8k x vocab logits).
        ``graph_decode``: the forward a decode step's CUDA graph captures (cuda_graphs.py);
        ``cache``: the step's (:meth:`step_cache`), by default a plain one of ``inputs``."""
        cache = cache if cache is not None else StepCache(self, inputs, graph_decode=graph_decode)
        kwargs = {self.cache_kwarg: cache}
        if rows is not None and self.keeps_logit_rows:
            kwargs["logits_to_keep"] = rows
        mode = deterministic_mode() if self.deterministic else contextlib.nullcontext()
        with self.attention.step(), mode, _without_hf_masks(self.model.config):  # (the step's attention plans)
            logits = self.model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=True,
                                **kwargs).logits[0]
        return logits if rows is None or self.keeps_logit_rows else logits[rows]


@contextlib.contextmanager
def _without_hf_masks(config):
    """Rename the attention implementation (the setter recurses into sub-configs) for the forward;
    restore each config's own value after (a multimodal config's parts may differ)."""
    configs = _all_configs(config)
    saved = [c._attn_implementation_internal for c in configs]
    config._attn_implementation = _NO_MASK_IMPLEMENTATION
    try:
        yield
    finally:
        for c, value in zip(configs, saved, strict=True):
            c._attn_implementation_internal = value


def _all_configs(config) -> list:
    subs = [getattr(config, key, None) for key in getattr(config, "sub_configs", {})]
    return [config] + [c for sub in subs if sub is not None for c in _all_configs(sub)]


def _history_pages(layout: CacheLayout, num_tokens: int) -> int:
    """Pages (at least one) a sequence of ``num_tokens`` cached tokens needs for its history."""
    return max(1, layout.num_quant_pages_for(layout.num_history_tokens(num_tokens)))


def runner_kwargs(model: torch.nn.Module, page_manager, config=None) -> dict:
    """The ``CompressedRunner`` arguments (besides model and layout) for a page manager's pools:
    pools sized from its page counts, step buffers, CUDA graphs and prefill semantics from the
    engine config (``EngineConfig``) when given. Plain values: tensor-parallel ranks receive them
    from rank 0."""
    # the engine's context limit (as build_engine sets it), within what the pools can hold:
    # it sizes the page-table mirrors, and the graphs plan their kernel splits for it
    max_model_len = ((config.scheduler.max_model_len if config is not None else None)
                     or model.config.get_text_config().max_position_embeddings)
    kwargs = dict(num_window_pages=page_manager.window_pool.num_pages,
                  num_quant_pages=page_manager.quant_pool.num_pages,
                  max_seq_len=min(max_model_len, page_manager.max_seq_len()))
    if config is not None:
        kwargs.update(max_num_seqs=config.scheduler.max_num_seqs,
                      max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                      cuda_graphs=config.runner.cuda_graphs, deterministic=config.runner.deterministic,
                      piecewise_max_tokens=config.runner.piecewise_max_tokens,
                      prefill_semantics=config.cache.prefill_semantics)
    swap = page_manager.swap_space
    kwargs.update(num_staging_pages=page_manager.staging_pool.num_pages,
                  swap_bytes=swap.num_bytes if swap is not None else 0)
    return kwargs


def runner_factory(compressed: Rewritten, layout: CacheLayout, config=None) -> RunnerFactory:
    """``make_runner`` for ``build_engine``: a CompressedRunner of ``compressed`` (what ``apply``
    returned) with :func:`runner_kwargs`."""
    semantics = config.cache.prefill_semantics if config is not None else DEFAULT_PREFILL_SEMANTICS
    return RunnerFactory(CompressedRunner.capabilities_for(semantics),
                         lambda page_manager: CompressedRunner(compressed, layout,
                                                               **runner_kwargs(compressed.model, page_manager,
                                                                               config)))


def compressed_layout(model: torch.nn.Module, spec) -> CacheLayout:
    """The runtime layout for a spec: INT-b history pages, or (every layer at 16 bits: the BF16
    mode) no windows and every token in a full-precision page."""
    config = model.config.get_text_config()
    dtype_bytes = torch.finfo(next(model.parameters()).dtype).bits // 8
    layout = CacheLayout.from_spec(spec, config, dtype_bytes=dtype_bytes)
    if layout.is_full_precision:
        return CacheLayout.bf16(layout.num_layers, layout.num_kv_heads, layout.head_dim,
                                page_size=layout.page_size, dtype_bytes=dtype_bytes)
    return layout
