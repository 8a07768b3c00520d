"""Deferred demotion on the runner side: staged rows attend to a full-precision history.

A staged sequence (page_manager, "Deferred demotion") is prefilling a prompt in several chunks.
``generate()`` computes the whole prompt at once, every token attending to every earlier one in
full precision, and only then quantizes the history. To match it, a staged row keeps its history
rows unquantized in *staging pages* (16-bit history rows, one pool pair per layer) while it
prefills, and runs the same ``oscar::`` ops with ``bits = 16`` over its own windows and its
staging table: demotions out of the ring copy rows into staging, attention reads them back as
stored. When its chunk caches its last known token (``Batch.staging_ends``), the staged history
rows are quantized into its quant pages by one bulk ``oscar::cache_write`` of positions
``[S0, S0 + h)`` with ``W = 0`` (every token straight into history, as a one-shot prefill writes
them): the same rounding to the window dtype, the same quantizer, the same codes.

A step mixes staged and other rows, and the rewritten graph calls each op once per layer. So per
INT-b layer, :meth:`StagedStep.layer_inputs` runs the staged rows' attention and writes itself,
then hands the graph the other rows only (or, when every row is staged, one padding token on the
scratch pages); :meth:`StagedStep.merge` puts the two outputs back in batch order. Layers on the
full-precision page ops (the BF16 mode's, or 16-bit layers without windows) store every token as
it is already: they run the whole batch as usual.

The op constants of each layer (attention scale, clip ratios) are read from the rewritten graph's
own op calls (``cache.op_constants.graph_op_constants``, which ``apply`` runs on each graph it rewrites;
the runner gets them from the handle ``apply`` returned), so the staged calls cannot drift from the graph's.
"""
from __future__ import annotations

import torch

from oscar_compile.cache.op_constants import OpConstants
from oscar_compile.formats.cache import CacheLayout
from oscar_compile.formats.op_args import POOLS, AttentionArgs, CacheWriteArgs
from oscar_compile.kernels.pools import FULL_PRECISION_BITS, allocate_pools
from oscar_compile.runtime.worker.runner import Batch


def allocate_staging_pools(layout: CacheLayout, num_pages: int, dtype: torch.dtype,
                           device: torch.device) -> tuple[torch.Tensor, ...]:
    """One layer's staging pools in ``oscar::`` history order: ``k_rows, k_scale, k_zero, v_rows,
    v_scale, v_zero`` with 16-bit rows ``[num_pages, H_kv, P, D]`` and empty scale / zero pools."""
    pools = allocate_pools(num_pages, 0, layout.num_kv_heads, layout.page_size, layout.head_dim,
                           FULL_PRECISION_BITS, window_dtype=dtype, device=device)
    return tuple(pools[2:])


def _ints(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _table(rows, width: int, fill: int, device) -> torch.Tensor:
    width = max(1, width)
    return _ints([list(r) + [fill] * (width - len(r)) for r in rows], device)


class StagedStep:
    """Index tensors of one step with staged rows, and the staged rows' ops per layer."""

    def __init__(self, batch: Batch, inputs: dict[str, torch.Tensor], layout: CacheLayout,
                 staging_pools: list[tuple[torch.Tensor, ...]], constants: dict[int, OpConstants],
                 scratch_window: int, scratch_quant: int, scratch_staging: int):
        device = inputs["cu_seqlens"].device
        self.layout, self.staging_pools, self.constants = layout, staging_pools, constants
        cu = batch.cu_seqlens()
        staged = [i for i, table in enumerate(batch.staging_tables) if table]
        others = [i for i in range(batch.num_seqs) if not batch.staging_tables[i]]
        self.num_tokens = cu[-1]
        self.all_staged = not others

        def token_index(rows):
            return torch.tensor([t for i in rows for t in range(cu[i], cu[i + 1])], dtype=torch.int64, device=device)

        def sub_cu(rows):
            offsets = [0]
            for i in rows:
                offsets.append(offsets[-1] + cu[i + 1] - cu[i])
            return _ints(offsets, device)

        rows_s = torch.tensor(staged, dtype=torch.int64, device=device)
        self.tok_s = None if self.all_staged else token_index(staged)
        self.cu_s = sub_cu(staged)
        self.cache_lens_s = inputs["cache_lens"].index_select(0, rows_s)
        self.history_lens_s = inputs["history_lens"].index_select(0, rows_s)
        self.window_s = inputs["window_table"].index_select(0, rows_s)
        widest = max(len(batch.staging_tables[i]) for i in staged)
        self.staging_s = _table([batch.staging_tables[i] for i in staged], widest, scratch_staging, device)
        # rows whose last known token is in this chunk: bulk-quantize their staged history
        def final_history(i):
            return layout.num_history_tokens(batch.cache_lens[i] + len(batch.token_ids[i]))

        ends = [i for i in batch.staging_ends if final_history(i) > 0]
        self.num_end_rows = len(ends)
        if ends:
            P, S0 = layout.page_size, layout.sink
            hist = [final_history(i) for i in ends]
            pages = [batch.staging_tables[i][:layout.num_quant_pages_for(h)] for i, h in zip(ends, hist, strict=True)]
            if any(len(p) * P < h for p, h in zip(pages, hist, strict=True)):
                raise RuntimeError("a staged sequence's staging table is shorter than its history")
            self.end_pages = torch.tensor([p for row in pages for p in row], dtype=torch.int64, device=device)
            offset, keep = 0, []
            for row, h in zip(pages, hist, strict=True):
                keep += range(offset, offset + h)
                offset += len(row) * P
            self.end_rows = torch.tensor(keep, dtype=torch.int64, device=device)
            self.end_cu = _ints([0] + [sum(hist[:k + 1]) for k in range(len(hist))], device)
            self.end_lens = _ints([S0] * len(ends), device)
            rows_f = torch.tensor(ends, dtype=torch.int64, device=device)
            self.end_window = inputs["window_table"].index_select(0, rows_f)
            self.end_quant = inputs["quant_table"].index_select(0, rows_f)
        if self.all_staged:  # the graph's ops get one padding token on the scratch pages
            window_width = inputs["window_table"].shape[1]
            self.rest = dict(cu=_ints([0, 1], device), cache_lens=_ints([0], device), history_lens=_ints([0], device),
                             window_table=_table([[]], window_width, scratch_window, device),
                             quant_table=_table([[]], 1, scratch_quant, device))
        else:
            rows_n = torch.tensor(others, dtype=torch.int64, device=device)
            self.tok_n = token_index(others)
            self.rest = dict(cu=sub_cu(others), cache_lens=inputs["cache_lens"].index_select(0, rows_n),
                             history_lens=inputs["history_lens"].index_select(0, rows_n),
                             window_table=inputs["window_table"].index_select(0, rows_n),
                             quant_table=inputs["quant_table"].index_select(0, rows_n))
        self._staged_out: dict[int, torch.Tensor] = {}

    def layer_inputs(self, layer_idx: int, q, k, v, pools: tuple) -> tuple:
        """Run the staged rows of an INT-b layer; the op inputs of the other rows (graph protocol).
        q: [N, H_q, D], k, v: [N, H_kv, D]."""
        c = self.constants[layer_idx]
        stage = self.staging_pools[layer_idx]
        k_win, v_win = pools[0], pools[1]
        if self.all_staged:
            q_s, k_s, v_s = q, k, v
        else:
            q_s, k_s, v_s = (x.index_select(0, self.tok_s) for x in (q, k, v))
        # the staged rows' history is the staging pools (16-bit rows; empty scale / zero pools)
        shared = dict(cu_seqlens=self.cu_s, cache_lens=self.cache_lens_s, window_table=self.window_s,
                      quant_table=self.staging_s, k_win=k_win, v_win=v_win,
                      **dict(zip(POOLS[2:], stage, strict=True)),
                      sink=c.layer.sink, recent=c.layer.recent, bits=FULL_PRECISION_BITS,
                      group_size=c.layer.group_size, history_lens=self.history_lens_s)
        self._staged_out[layer_idx] = torch.ops.oscar.attention(
            *AttentionArgs(q=q_s, k=k_s, v=v_s, scale=c.scale, **shared))
        torch.ops.oscar.cache_write(*CacheWriteArgs(k=k_s, v=v_s, clip_k=c.clip_k, clip_v=c.clip_v, **shared))
        if self.num_end_rows:
            self._quantize_staged(c, stage, pools)
        rest = self.rest
        if self.all_staged:
            q_n, k_n, v_n = (x.new_zeros((1, *x.shape[1:])) for x in (q, k, v))
        else:
            q_n, k_n, v_n = (x.index_select(0, self.tok_n) for x in (q, k, v))
        return (q_n, k_n, v_n, rest["cu"], rest["cache_lens"], rest["window_table"], rest["quant_table"], *pools,
                rest["cu"], rest["history_lens"])

    def _quantize_staged(self, c: OpConstants, stage: tuple, pools: tuple) -> None:
        """Staged history rows of the ending rows -> their quant pages: positions ``[S0, S0 + h)``
        written at once after the sink (L = S0, W = 0: straight into history rows 0..h-1)."""
        H, D = self.layout.num_kv_heads, self.layout.head_dim

        def rows(pool):  # [n_pages, H, P, D] -> [n_pages * P, H, D] -> the kept rows
            return pool.index_select(0, self.end_pages).transpose(1, 2).reshape(-1, H, D).index_select(0, self.end_rows)

        k_rows, v_rows = rows(stage[0]), rows(stage[3])
        torch.ops.oscar.cache_write(*CacheWriteArgs(
            k=k_rows, v=v_rows, cu_seqlens=self.end_cu, cache_lens=self.end_lens, window_table=self.end_window,
            quant_table=self.end_quant, **dict(zip(POOLS, pools, strict=True)), sink=c.layer.sink, recent=0,
            bits=c.layer.bits, group_size=c.layer.group_size, clip_k=c.clip_k, clip_v=c.clip_v))

    def merge(self, layer_idx: int, out: torch.Tensor) -> torch.Tensor:
        """The layer's output for every token, batch order: [N, H_q, D]."""
        staged = self._staged_out.pop(layer_idx)
        if self.all_staged:
            return staged
        full = out.new_empty((self.num_tokens, *out.shape[1:]))
        full.index_copy_(0, self.tok_s, staged)
        full.index_copy_(0, self.tok_n, out)
        return full
