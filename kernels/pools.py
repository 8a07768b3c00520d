"""One allocator and one address map for the paged KV cache of one layer (docs/cache-format.md).

The HF ``generate()`` cache, the runtime's page manager, the references and the Triton kernels
all use the same pool shapes and the same position -> (page, row) rule, so both live here:

- pools: ``k_win, v_win: [N_w, H_kv, P, D]`` (model dtype); ``k_codes, v_codes:
  [N_q, H_kv, P, D * b / 8]`` uint8; ``k_scale, k_zero, v_scale, v_zero: [N_q, H_kv, P, D / G]``
  (scale dtype). :class:`CachePools` keeps them in the order the ``oscar::`` ops take them, so
  ``op(..., *pools, ...)`` works. ``b = 16`` (:data:`FULL_PRECISION_BITS`, a layer kept at 16
  bits beside INT-b layers) keeps the windows and stores history rows as they are: ``k_codes,
  v_codes: [N_q, H_kv, P, D]`` in the model dtype, scale / zero pools with no group column.
- a position ``p`` of a sequence holding ``L`` tokens is in the sink when ``p < S0``, in the
  history when ``S0 <= p < S0 + h`` (``h = max(0, L - W - S0)``, or more right after a prefix-cache
  hit: :func:`history_lens_of`), else in the recent window (a ring of ``W`` slots after the
  ``S0`` sink slots: slot ``S0 + (p - S0) % W``).

Pools are zero-filled rather than left uninitialised: a kernel that reads a padded row must never
meet a NaN bit pattern (0 * NaN is NaN even under a zero softmax weight).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from oscar_compile.formats.cache import FULL_PRECISION_BITS, LayerFormat, check_windows, num_pages_for
from oscar_compile.formats.cache import num_history_tokens as _num_history_tokens
from oscar_compile.quant import SUPPORTED_BITS, scale_dtype_of


class CachePools(NamedTuple):
    """The eight per-layer pools, in ``oscar::cache_write`` / ``oscar::attention`` argument order."""

    k_win: torch.Tensor  # [N_w, H_kv, P, D] model dtype
    v_win: torch.Tensor  # [N_w, H_kv, P, D]
    k_codes: torch.Tensor  # [N_q, H_kv, P, D*b/8] uint8
    k_scale: torch.Tensor  # [N_q, H_kv, P, D/G] scale dtype
    k_zero: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor


def allocate_pools(
    num_quant_pages: int,
    num_window_pages: int,
    num_kv_heads: int,
    page_size: int,
    head_dim: int,
    bits: int = 2,
    group_size: int = 128,
    scale_dtype: str | torch.dtype = torch.float16,
    window_dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> CachePools:
    """Zero-filled pools for one layer. Page 0 may be used like any other page (tables pad with 0).

    ``bits = 16``: full-precision history rows in ``k_codes`` / ``v_codes`` (``window_dtype``),
    empty scale / zero pools (``group_size`` is not used)."""
    H, P, D = num_kv_heads, page_size, head_dim
    codes_dtype = torch.uint8
    if bits == FULL_PRECISION_BITS:
        codes, codes_dtype = (num_quant_pages, H, P, D), window_dtype
        groups = (num_quant_pages, H, P, 0)
    elif bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS} or {FULL_PRECISION_BITS}, got {bits}")
    elif head_dim % group_size:
        raise ValueError(f"group_size {group_size} does not divide head_dim {head_dim}")
    elif (head_dim * bits) % 8:
        raise ValueError(f"head_dim {head_dim} * bits {bits} is not a whole number of bytes")
    else:
        codes = (num_quant_pages, H, P, D * bits // 8)
        groups = (num_quant_pages, H, P, D // group_size)
    sdt = scale_dtype_of(scale_dtype)
    win = (num_window_pages, H, P, D)

    def z(shape, dtype):
        return torch.zeros(shape, dtype=dtype, device=device)

    return CachePools(
        k_win=z(win, window_dtype),
        v_win=z(win, window_dtype),
        k_codes=z(codes, codes_dtype),
        k_scale=z(groups, sdt),
        k_zero=z(groups, sdt),
        v_codes=z(codes, codes_dtype),
        v_scale=z(groups, sdt),
        v_zero=z(groups, sdt),
    )


def allocate_layer_pools(fmt: LayerFormat, num_quant_pages: int, num_window_pages: int, num_kv_heads: int,
                         head_dim: int, window_dtype: torch.dtype = torch.bfloat16,
                         device: str | torch.device = "cpu") -> CachePools:
    """:func:`allocate_pools` for one layer of the cache format: its page size, bits, group size and
    scale dtype from ``fmt`` (the HF cache and the runtime allocate a layer this way; the kernels'
    tests and benchmarks, which sweep the plain numbers, call :func:`allocate_pools`)."""
    return allocate_pools(num_quant_pages, num_window_pages, num_kv_heads, fmt.page_size, head_dim, fmt.bits,
                          fmt.group_size, fmt.scale_dtype, window_dtype, device)


def attention_output_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pools, history_lens,
                         num_seqs: int, allocate: bool = True) -> torch.Tensor | None:
    """The empty output [N, H_q, D] (q's dtype) of an attention kernel call, after checking what
    the kernels' wrappers (Triton and Gluon alike) require of their tensors: unit-stride q / k / v
    rows, contiguous pools (the kernels compute page offsets from the shapes) and
    ``history_lens`` of one entry per sequence when given. (``allocate=False``: the checks only.)"""
    if history_lens is not None and history_lens.shape != (num_seqs,):
        raise ValueError(f"history_lens must be [B] = [{num_seqs}], got {tuple(history_lens.shape)}")
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("q, k, v need a contiguous last dim")
    for t in pools:
        if not t.is_contiguous():
            raise ValueError("the cache pools must be contiguous")
    return torch.empty(q.shape, dtype=q.dtype, device=q.device) if allocate else None


def check_window_config(sink: int, recent: int, page_size: int) -> None:
    """S0 and W must be non-negative multiples of P (``oscar_compile.formats.cache.check_windows``)."""
    check_windows(sink, recent, page_size)


def num_window_pages_per_seq(sink: int, recent: int, page_size: int) -> int:
    """Columns of ``window_table``: (S0 + W) / P."""
    check_window_config(sink, recent, page_size)
    return (sink + recent) // page_size


def num_history_tokens(cache_len: int, sink: int, recent: int) -> int:
    """Quantized tokens of a sequence holding ``cache_len`` tokens: len([S0, L - W))."""
    return _num_history_tokens(cache_len, sink, recent)


def history_lens_of(cache_lens: torch.Tensor, history_lens: torch.Tensor | None, sink: int,
                    recent: int) -> list[int]:
    """h per sequence as host ints, for the references: ``history_lens`` when given, else the
    standard ``max(0, L - W - S0)``.

    A given h must leave a ring the window can hold: the ring holds positions ``[S0 + h, L)``, so
    ``max(0, L - W - S0) <= h <= max(0, L - S0)`` (after a prefix-cache hit, h exceeds the lower
    bound while the ring refills).
    """
    lens = cache_lens.tolist()
    derived = [num_history_tokens(L, sink, recent) for L in lens]
    if history_lens is None:
        return derived
    given = history_lens.tolist()
    if len(given) != len(lens):
        raise ValueError(f"history_lens has {len(given)} entries for {len(lens)} sequences")
    for i, (L, h, lo) in enumerate(zip(lens, given, derived, strict=True)):
        if not lo <= h <= max(0, L - sink):
            raise ValueError(f"sequence {i}: history_lens {h} outside [{lo}, {max(0, L - sink)}] "
                             f"for cache_lens {L}, sink {sink}, recent {recent}")
    return given


def num_quant_pages_needed(cache_len: int, sink: int, recent: int, page_size: int) -> int:
    """History pages a sequence needs once it holds ``cache_len`` tokens (allocate before writing)."""
    return num_pages_for(num_history_tokens(cache_len, sink, recent), page_size)


def window_slot(pos: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """Window slot of positions in the sink or recent window: p if p < S0 else S0 + (p - S0) % W."""
    if recent == 0:
        return pos.clone()
    return torch.where(pos < sink, pos, sink + (pos - sink) % recent)


def index_runs(firsts: list[int], counts: list[int]) -> torch.Tensor:
    """The indices first_i, first_i + 1, ..., first_i + count_i - 1 of every run, concatenated
    (int64, on the host: built from host ints, no device sync)."""
    n = torch.tensor(counts, dtype=torch.int64)
    run_start = torch.repeat_interleave(torch.tensor(firsts, dtype=torch.int64) - (n.cumsum(0) - n), n)
    return run_start + torch.arange(int(n.sum()), dtype=torch.int64)
