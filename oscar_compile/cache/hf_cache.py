"""The compressed KV cache behind Hugging Face ``generate()`` and ``model(..., past_key_values=cache)``.

A ``transformers`` ``Cache`` whose layers hold the paged pools of docs/cache-format.md: one window
ring of S0 + W slots and growing history pages per batch row (quantized, or 16-bit rows for a
layer kept at 16 bits beside quantized ones), or only full-precision pages for a 16-bit layer
without windows. The rewritten attention graphs read and write it through
``oscar::attention`` / ``oscar::cache_write``, by the contract of ``oscar_compile.cache.contract``
(its two graph nodes turn the padded ``[B, H, T, D]`` tensors HF uses into the flat token lists
the ops take, and back); each layer's pools are allocated from its
:class:`~oscar_compile.formats.cache.LayerFormat`, which also gives its page size.

Left padding: each forward tells the cache which new tokens are real (``begin_step``, called by
a pre-hook on the model with its 2-D attention mask); pad tokens are never cached, so every row's
sink, recent window and history count its own tokens only.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from ..formats.cache import LayerFormat
from ..kernels.pools import allocate_layer_pools, num_quant_pages_needed, num_window_pages_per_seq
from .contract import PagedAttentionCache
from .decode_consistent import run_decode_consistent


class _PagedLayer(CacheLayerMixin):
    """What both paged layer kinds share: HF's view of the length, per-row real lengths."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, fmt: LayerFormat):
        super().__init__()
        self.format = fmt
        self.num_positions = 0  # positions seen, pads included (what HF's masks count)
        self.cache_lens: torch.Tensor | None = None  # [B] int32 real tokens cached per row

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("an oscar cache layer is written by the oscar:: cache-write ops, not Cache.update")

    @property
    def page_size(self) -> int:
        return self.format.page_size

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.num_positions + query_length, 0

    def get_seq_length(self) -> int:
        return self.num_positions

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        self.num_positions = 0
        self.cache_lens = None

    def _pages_needed(self, cache_len: int) -> int:
        raise NotImplementedError

    def _grow(self, num_rows: int, num_new_pages: int) -> int:
        """Append ``num_rows * num_new_pages`` zeroed pages; return the id of the first."""
        raise NotImplementedError

    def reserve(self, new_lens: torch.Tensor) -> None:
        """Give every row enough pages for ``new_lens`` cached tokens (one host sync per step)."""
        need = max(self._pages_needed(int(n)) for n in new_lens.tolist())
        have = self.page_table.shape[1]
        if need <= have:
            return
        B = self.page_table.shape[0]
        grow = max(need - have, have)  # amortised doubling
        first = self._grow(B, grow)
        new_pages = torch.arange(first, first + B * grow, dtype=torch.int32, device=self.page_table.device)
        self.page_table = torch.cat([self.page_table, new_pages.reshape(B, grow)], dim=1)


class OscarLayer(_PagedLayer):
    """A layer with windows: window ring + history pages per batch row (docs/cache-format.md);
    the history is quantized, or kept at 16 bits (``bits = 16``)."""

    def __init__(self, fmt: LayerFormat):
        super().__init__(fmt)
        self.pools = None
        self.window_table: torch.Tensor | None = None  # [B, (S0 + W) / P] int32
        self.page_table: torch.Tensor | None = None  # the history (quant) table [B, pages per row]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H_kv, _, D = key_states.shape
        device = key_states.device
        fmt = self.format
        per_row = num_window_pages_per_seq(fmt.sink, fmt.recent, fmt.page_size)
        self.window_table = torch.arange(B * per_row, dtype=torch.int32, device=device).reshape(B, per_row)
        self.page_table = torch.zeros(B, 0, dtype=torch.int32, device=device)
        self.cache_lens = torch.zeros(B, dtype=torch.int32, device=device)
        self.pools = allocate_layer_pools(fmt, 0, max(1, B * per_row), H_kv, D, key_states.dtype, device)
        self.is_initialized = True

    def reset(self) -> None:
        super().reset()
        self.pools = self.window_table = self.page_table = None

    def _pages_needed(self, cache_len: int) -> int:
        return num_quant_pages_needed(cache_len, self.format.sink, self.format.recent, self.page_size)

    def _grow(self, num_rows: int, num_new_pages: int) -> int:
        first = self.pools.k_codes.shape[0]
        win = self.pools.k_win
        extra = allocate_layer_pools(self.format, num_rows * num_new_pages, 0, win.shape[1], win.shape[3],
                                     win.dtype, win.device)
        self.pools = type(self.pools)(*(
            old if name in ("k_win", "v_win") else torch.cat([old, new])
            for name, old, new in zip(self.pools._fields, self.pools, extra, strict=True)
        ))
        return first

    def op_inputs(self) -> tuple:
        """(cache_lens, window_table, quant_table, *8 pools): the cache arguments of the INT-b ops."""
        return (self.cache_lens, self.window_table, self.page_table, *self.pools)


class FullPrecisionLayer(_PagedLayer):
    """A 16-bit layer without windows: every token in full-precision pages (``oscar::*_bf16``)."""

    def __init__(self, fmt: LayerFormat):
        super().__init__(fmt)
        self.k_pages = self.v_pages = self.page_table = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H_kv, _, D = key_states.shape
        device = key_states.device
        self.page_table = torch.zeros(B, 0, dtype=torch.int32, device=device)
        self.cache_lens = torch.zeros(B, dtype=torch.int32, device=device)
        self.k_pages = torch.zeros(0, H_kv, self.page_size, D, dtype=key_states.dtype, device=device)
        self.v_pages = torch.zeros_like(self.k_pages)
        self.is_initialized = True

    def reset(self) -> None:
        super().reset()
        self.k_pages = self.v_pages = self.page_table = None

    def _pages_needed(self, cache_len: int) -> int:
        return -(-cache_len // self.page_size)

    def _grow(self, num_rows: int, num_new_pages: int) -> int:
        first = self.k_pages.shape[0]
        extra = self.k_pages.new_zeros((num_rows * num_new_pages, *self.k_pages.shape[1:]))
        self.k_pages = torch.cat([self.k_pages, extra])
        self.v_pages = torch.cat([self.v_pages, torch.zeros_like(extra)])
        return first

    def op_inputs(self) -> tuple:
        """(cache_lens, page_table, k_pages, v_pages): the cache arguments of the full-precision ops."""
        return (self.cache_lens, self.page_table, self.k_pages, self.v_pages)


def _new_layer(layer: LayerFormat) -> _PagedLayer:
    return FullPrecisionLayer(layer) if layer.full_precision_pages else OscarLayer(layer)


class OscarCache(Cache, PagedAttentionCache):
    """HF cache: one paged layer per layer of the rewritten model.

    The rewritten graphs talk to it through the two methods of
    :class:`~oscar_compile.cache.contract.PagedAttentionCache`; the runtime's cache implements
    the same two over its own pages.
    """

    def __init__(self, layers: list[LayerFormat | None], decode_consistent: dict | None = None):
        """``layers[i]``: the pools of layer i; None gives a placeholder ``DynamicLayer`` (a cache
        that keeps its pages itself, as the runtime's StepCache).

        ``decode_consistent``: None for the prompt-exact prefill semantics; else the decode-consistent
        one (formats/prefill.py), with each INT-b layer's op constants (``cache.op_constants``:
        layer index -> ``OpConstants``) for :func:`~oscar_compile.cache.decode_consistent.run_decode_consistent`."""
        layers = [DynamicLayer() if g is None else _new_layer(g) for g in layers]
        super().__init__(layers=layers)
        self.step_mask: torch.Tensor | None = None  # [B, T] bool: the real new tokens of this forward
        self.decode_consistent = decode_consistent
        self._outputs: dict[int, torch.Tensor] = {}  # decode-consistent outputs, until the graph hands in its own

    def begin_step(self, attention_mask: torch.Tensor | None, num_new: int) -> None:
        """Record which of the ``num_new`` tokens of the coming forward are real (not padding)."""
        self.step_mask = None if attention_mask is None else attention_mask[:, -num_new:].bool()

    def reorder_cache(self, beam_idx: torch.LongTensor):
        raise NotImplementedError("beam search is not supported with the oscar INT2 cache")

    def _mask(self, q: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = q.shape
        mask = self.step_mask
        if mask is None or mask.shape != (B, T):
            return torch.ones(B, T, dtype=torch.bool, device=q.device)
        return mask.to(q.device)

    def oscar_layer_inputs(self, layer_idx: int, q, k, v, layer: LayerFormat) -> tuple:
        state = self.layers[layer_idx]
        if not state.is_initialized:
            state.lazy_initialization(k, v)
        mask = self._mask(q)
        counts = mask.sum(dim=1, dtype=torch.int32)
        state.reserve(state.cache_lens + counts)
        cu = _cu_seqlens(counts)
        inputs = (*_flatten(mask, q, k, v), cu, *state.op_inputs(), cu, None)  # standard rings: no history_lens
        if self.decode_consistent is None or layer.full_precision_pages:
            return inputs
        c = self.decode_consistent[layer_idx]
        self._outputs[layer_idx], inputs = run_decode_consistent(inputs, layer, c.scale, c.clip_k, c.clip_v)
        return inputs

    def oscar_layer_outputs(self, layer_idx: int, out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        out = self._outputs.pop(layer_idx, out)
        mask = self._mask(q)
        state = self.layers[layer_idx]
        state.cache_lens += mask.sum(dim=1, dtype=torch.int32)
        state.num_positions += q.shape[2]
        return _unflatten(mask, out, q)


def _cu_seqlens(counts: torch.Tensor) -> torch.Tensor:
    cu = torch.zeros(counts.shape[0] + 1, dtype=torch.int32, device=counts.device)
    cu[1:] = torch.cumsum(counts, 0)
    return cu


def _flatten(mask: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
    """[B, H, T, D] tensors -> [N, H, D] holding the tokens where mask [B, T] is set, row after row."""
    return [x.transpose(1, 2)[mask] for x in xs]


def _unflatten(mask: torch.Tensor, out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[N, H, D] -> HF's attention-output layout [B, T, H, D], zeros at masked (pad) tokens."""
    B, H, T, D = q.shape
    full = torch.zeros(B, T, H, D, dtype=out.dtype, device=out.device)
    full[mask] = out
    return full


def uncached_layer_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerFormat) -> tuple:
    """The op inputs of a forward without a cache: attention within the chunk only, nothing kept."""
    B, _, T, _ = q.shape
    mask = torch.ones(B, T, dtype=torch.bool, device=q.device)
    state = _new_layer(layer)
    state.lazy_initialization(k, v)
    cu = _cu_seqlens(mask.sum(dim=1, dtype=torch.int32))
    return (*_flatten(mask, q, k, v), cu, *state.op_inputs(), torch.zeros_like(cu), None)


def uncached_layer_outputs(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[N, H_q, D] -> [B, T, H_q, D] for a forward without a cache (every token real)."""
    B, _, T, _ = q.shape
    return _unflatten(torch.ones(B, T, dtype=torch.bool, device=q.device), out, q)
