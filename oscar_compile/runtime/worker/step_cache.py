"""The cache a ``CompressedRunner`` step runs its rewritten graphs on: the step's packed tokens over the runner's pages.

Each step packs every sequence's new tokens into one row ``[1, N]``; the graphs ask this cache for
their op inputs (``oscar_layer_inputs``) and it answers with the flattened tokens, the batch's
``cu_seqlens``, ``cache_lens`` and page tables, and the layer's pools (compressed_runner.py says
which pools each layer kind has). Under decode-consistent prefill it runs the layer's attention
itself (cache/decode_consistent.py); staged rows and window snapshots taken inside the step run
here too. Eager steps, decode graphs' captures and piecewise graphs' replays share it.
"""
from __future__ import annotations

import torch

from oscar_compile.cache.decode_consistent import RowPart, run_decode_consistent
from oscar_compile.cache.hf_cache import OscarCache
from oscar_compile.formats.cache import LayerFormat
from oscar_compile.runtime.worker.snapshot_takes import StepSnapshotTakes
from oscar_compile.runtime.worker.staging import StagedStep


class StepCache(OscarCache):
    """One packed step of many sequences, seen through the cache protocol of the rewritten graphs.
    ``runner``: the ``CompressedRunner`` (its pools, layout and decode-consistent constants; not
    imported here, since the runner builds its steps' caches)."""

    def __init__(self, runner, inputs: dict[str, torch.Tensor], staged: StagedStep | None = None,
                 graph_decode: bool = False, takes: StepSnapshotTakes | None = None,
                 row_parts: list[RowPart] | None = None):
        super().__init__([None] * runner.num_layers)
        self.runner = runner
        self.staged = staged
        self.takes = takes  # window snapshots taken inside the step's chunks, before each layer's write
        self.graph_decode = graph_decode  # the forward of a decode step's CUDA graph (warm-up or capture)
        self.row_parts = row_parts  # decode-consistent rows by kind, split on the host once per step
        self.cu = inputs["cu_seqlens"]
        self.cache_lens = inputs["cache_lens"]
        self.history_lens = inputs["history_lens"]
        self.window_table = inputs["window_table"]
        self.quant_table = inputs["quant_table"]
        self._outputs: dict[int, torch.Tensor] = {}  # decode-consistent outputs, until the graph hands in its own
        self._memo: dict = {}  # what the decode-consistent kernel makes once per step (its step_memo)

    def begin_step(self, attention_mask, num_new: int) -> None:  # the runner packs tokens itself
        pass

    def oscar_layer_inputs(self, layer_idx: int, q, k, v, layer: LayerFormat) -> tuple:
        flat = [x[0].transpose(0, 1) for x in (q, k, v)]  # [1, H, N, D] -> [N, H, D]
        pools = self.runner.pools[layer_idx]
        if layer.full_precision_pages:  # the quant table is a table of every token
            return (*flat, self.cu, self.cache_lens, self.quant_table, *pools, self.cu, None)
        if self.takes is not None:  # before anything writes the ring
            self.takes.take(flat[1], flat[2], *pools[:2])
        if self.staged is not None:  # staged rows run here, the graph's ops take the others
            return self.staged.layer_inputs(layer_idx, *flat, pools)
        inputs = (*flat, self.cu, self.cache_lens, self.window_table, self.quant_table, *pools, self.cu,
                  self.history_lens)
        # a captured decode step (one token per sequence) runs the graph's ops: the one-token case
        # of the decode-consistent rule, without the host reads of run_decode_consistent
        if self.runner.decode_consistent is None or self.graph_decode:
            return inputs
        c = self.runner.decode_consistent[layer_idx]  # every row runs here, the graph's ops get an empty chunk
        self._outputs[layer_idx], inputs = run_decode_consistent(inputs, layer, c.scale, c.clip_k, c.clip_v,
                                                                 parts=self.row_parts, step_memo=self._memo)
        return inputs

    def run_attention(self, layer_idx: int, q, k, v, layer: LayerFormat, core) -> torch.Tensor:
        """What the layer's graph runs from its first cache node through its second, the graph's
        calls between them given as ``core`` (cache/attention_core.py): piecewise graphs run it
        between their pieces. Returns ``[1, N, H_q, D]``."""
        inputs = self.oscar_layer_inputs(layer_idx, q, k, v, layer)
        out = None if layer_idx in self._outputs else core(inputs)  # decode-consistent rows ran already
        return self.oscar_layer_outputs(layer_idx, out, q)

    def oscar_layer_outputs(self, layer_idx: int, out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        out = self._outputs.pop(layer_idx, out)
        if self.staged is not None and not self.runner.layout.format_of(layer_idx).full_precision_pages:
            out = self.staged.merge(layer_idx, out)
        return out.unsqueeze(0)  # [N, H, D] -> [1, N, H, D]
