"""The compressed KV cache behind Hugging Face ``generate()`` and ``model(..., past_key_values=cache)``.

A ``transformers`` ``Cache`` whose quantized layers hold the paged pools of docs/cache-format.md
(one window ring of S0 + W slots and growing history pages per batch row) and whose 16-bit
layers are ordinary ``DynamicLayer``s. The rewritten attention graphs read and write it through
``oscar::attention`` / ``oscar::cache_write``; :func:`layer_inputs` and :func:`layer_outputs`
are the two graph nodes that turn the padded ``[B, H, T, D]`` tensors HF uses into the flat
token lists the ops take, and back.

Left padding: each forward tells the cache which new tokens are real (``begin_step``, called by
a pre-hook on the model with its 2-D attention mask); pad tokens are never cached, so every row's
sink, recent window and history count its own tokens only.
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from ..kernels.pools import allocate_pools, num_quant_pages_needed, num_window_pages_per_seq
from ..spec import LayerSpec
from ..quant import scale_dtype_of


class OscarLayer(CacheLayerMixin):
    """One quantized layer: pools, per-row tables and lengths. Allocated on first write."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, sink: int, recent: int, page_size: int, bits: int, group_size: int, scale_dtype: str):
        super().__init__()
        self.sink, self.recent, self.page_size = sink, recent, page_size
        self.bits, self.group_size, self.scale_dtype = bits, group_size, scale_dtype_of(scale_dtype)
        self.num_positions = 0  # positions seen, pads included (what HF's masks count)
        self.cache_lens: Optional[torch.Tensor] = None  # [B] int32 real tokens cached per row
        self.pools = None
        self.window_table: Optional[torch.Tensor] = None  # [B, (S0 + W) / P] int32
        self.quant_table: Optional[torch.Tensor] = None  # [B, num pages per row] int32

    # -- HF cache-layer protocol -----------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H_kv, _, D = key_states.shape
        device = key_states.device
        per_row = num_window_pages_per_seq(self.sink, self.recent, self.page_size)
        self.window_table = torch.arange(B * per_row, dtype=torch.int32, device=device).reshape(B, per_row)
        self.quant_table = torch.zeros(B, 0, dtype=torch.int32, device=device)
        self.cache_lens = torch.zeros(B, dtype=torch.int32, device=device)
        self.pools = allocate_pools(0, max(1, B * per_row), H_kv, self.page_size, D, self.bits, self.group_size,
                                    self.scale_dtype, key_states.dtype, device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("a quantized oscar layer is written by oscar::cache_write, not Cache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.num_positions + query_length, 0

    def get_seq_length(self) -> int:
        return self.num_positions

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        self.num_positions = 0
        self.cache_lens = self.pools = self.window_table = self.quant_table = None

    # -- growth ----------------------------------------------------------------------------
    def reserve(self, new_lens: torch.Tensor) -> None:
        """Give every row enough history pages for ``new_lens`` cached tokens (one host sync per step)."""
        need = max(num_quant_pages_needed(int(n), self.sink, self.recent, self.page_size) for n in new_lens.tolist())
        have = self.quant_table.shape[1]
        if need <= have:
            return
        B = self.quant_table.shape[0]
        grow = max(need - have, have)  # amortised doubling
        first = self.pools.k_codes.shape[0]
        extra = allocate_pools(B * grow, 0, self.pools.k_win.shape[1], self.page_size, self.pools.k_win.shape[3],
                               self.bits, self.group_size, self.scale_dtype, self.pools.k_win.dtype,
                               self.pools.k_win.device)
        self.pools = type(self.pools)(*(
            old if name in ("k_win", "v_win") else torch.cat([old, new])
            for name, old, new in zip(self.pools._fields, self.pools, extra)
        ))
        new_pages = torch.arange(first, first + B * grow, dtype=torch.int32, device=self.quant_table.device)
        self.quant_table = torch.cat([self.quant_table, new_pages.reshape(B, grow)], dim=1)


class OscarCache(Cache):
    """HF cache with one :class:`OscarLayer` per quantized layer and a ``DynamicLayer`` per 16-bit one."""

    def __init__(self, layer_specs: list[Optional[LayerSpec]]):
        """``layer_specs[i]`` is the resolved spec of a quantized layer, None for a 16-bit one."""
        layers = [DynamicLayer() if s is None else OscarLayer(*cache_geometry(s)) for s in layer_specs]
        super().__init__(layers=layers)
        self.step_mask: Optional[torch.Tensor] = None  # [B, T] bool: the real new tokens of this forward

    def begin_step(self, attention_mask: Optional[torch.Tensor], num_new: int) -> None:
        """Record which of the ``num_new`` tokens of the coming forward are real (not padding)."""
        self.step_mask = None if attention_mask is None else attention_mask[:, -num_new:].bool()

    def reorder_cache(self, beam_idx: torch.LongTensor):
        raise NotImplementedError("beam search is not supported with the oscar INT2 cache")


def cache_geometry(layer: LayerSpec) -> tuple:
    """(sink, recent, page_size, bits, group_size, scale_dtype) of a layer: what its pools look like."""
    kv = layer.kv_cache
    return kv.sink_tokens, kv.recent_tokens, kv.page_size, kv.bits, kv.group_size, kv.scale_dtype


def layer_inputs(cache: Optional[Cache], layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 *geometry) -> tuple:
    """Flatten the real new tokens for the ops. q: [B, H_q, T, D]; k, v: [B, H_kv, T, D] (rotated).

    Returns (q, k, v, cu_seqlens, cache_lens, window_table, quant_table, *pools, write_cu) with
    q/k/v as [N, H, D]. ``write_cu`` is ``cu_seqlens`` when there is a cache to write, all zeros
    (nothing written) when the forward runs without one.
    """
    B, _, T, _ = q.shape
    has_cache = isinstance(cache, OscarCache)
    mask = cache.step_mask if has_cache else None
    if mask is None or mask.shape != (B, T):
        mask = torch.ones(B, T, dtype=torch.bool, device=q.device)
    mask = mask.to(q.device)
    counts = mask.sum(dim=1, dtype=torch.int32)
    cu = torch.zeros(B + 1, dtype=torch.int32, device=q.device)
    cu[1:] = torch.cumsum(counts, 0)
    state = cache.layers[layer_idx] if has_cache else OscarLayer(*geometry)
    if not state.is_initialized:
        state.lazy_initialization(k, v)
    if has_cache:
        state.reserve(state.cache_lens + counts)
    flat = [x.transpose(1, 2)[mask] for x in (q, k, v)]  # [N, H, D], row after row
    write_cu = cu if has_cache else torch.zeros_like(cu)
    return (*flat, cu, state.cache_lens, state.window_table, state.quant_table, *state.pools, write_cu)


def layer_outputs(cache: Optional[Cache], layer_idx: int, out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Scatter the ops' output [N, H_q, D] back to HF's [B, T, H_q, D] and advance the cache lengths."""
    B, H, T, D = q.shape
    has_cache = isinstance(cache, OscarCache)
    mask = cache.step_mask if has_cache else None
    if mask is None or mask.shape != (B, T):
        mask = torch.ones(B, T, dtype=torch.bool, device=q.device)
    mask = mask.to(q.device)
    full = torch.zeros(B, T, H, D, dtype=out.dtype, device=out.device)
    full[mask] = out
    if has_cache:
        state = cache.layers[layer_idx]
        state.cache_lens += mask.sum(dim=1, dtype=torch.int32)
        state.num_positions += T
    return full
