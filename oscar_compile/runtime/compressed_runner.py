"""The model runner for a model rewritten by ``oscar_compile.apply``: the ``oscar::`` ops over the runtime's pages.

Each step packs every sequence's new tokens into one row ``[1, N]`` with their positions, and
runs the rewritten model with a :class:`StepCache`: the graphs ask it for their op inputs
(``oscar_layer_inputs``) and it answers with the flattened tokens, the batch's ``cu_seqlens``,
``cache_lens`` and page tables, and the layer's pools. Quantized layers use the window ring +
history pages; in the BF16 mode (a spec with ``bits: 16``) the runtime's quant pages hold
full-precision rows and the quant table is a plain page table (``oscar::attention_bf16``).
On CUDA the ops run the Triton kernels, on CPU their references.
"""
from __future__ import annotations

import inspect

import torch

from oscar_compile.kernels.pools import allocate_pools
from oscar_compile.passes.hf_cache import OscarCache
from oscar_compile.runtime.pages import CacheLayout
from oscar_compile.runtime.runner import Batch


def _padded(rows: list[list[int]], device) -> torch.Tensor:
    width = max(1, max((len(r) for r in rows), default=0))
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, r in enumerate(rows):
        if r:
            table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return table.to(device)


class StepCache(OscarCache):
    """One packed step of many sequences, seen through the cache protocol of the rewritten graphs."""

    def __init__(self, runner: "CompressedRunner", batch: Batch, device: torch.device):
        super().__init__([None] * runner.num_layers)
        self.runner = runner
        self.cu = torch.tensor(batch.cu_seqlens(), dtype=torch.int32, device=device)
        self.cache_lens = torch.tensor(batch.cache_lens, dtype=torch.int32, device=device)
        self.history_lens = torch.tensor(batch.history_lens, dtype=torch.int32, device=device)
        self.window_table = _padded(batch.window_tables, device)
        self.quant_table = _padded(batch.quant_tables, device)

    def begin_step(self, attention_mask, num_new: int) -> None:  # the runner packs tokens itself
        pass

    def oscar_layer_inputs(self, layer_idx: int, q, k, v, geometry: tuple) -> tuple:
        flat = [x[0].transpose(0, 1) for x in (q, k, v)]  # [1, H, N, D] -> [N, H, D]
        pools = self.runner.pools[layer_idx]
        if geometry[3] == 16:
            cache_args = (self.cache_lens, self.quant_table, *pools)
        else:
            cache_args = (self.cache_lens, self.window_table, self.quant_table, *pools)
        history_lens = None if geometry[3] == 16 else self.history_lens  # the INT-b ops' ring state
        return (*flat, self.cu, *cache_args, self.cu, history_lens)

    def oscar_layer_outputs(self, layer_idx: int, out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return out.unsqueeze(0)  # [N, H, D] -> [1, N, H, D]


class CompressedRunner:
    """Runs ``model`` (already rewritten by ``apply``) over the engine's page tables."""

    supports_history_hits = True  # the INT-b ops get Batch.history_lens (see block_manager)

    def __init__(self, model: torch.nn.Module, layout: CacheLayout, num_window_pages: int, num_quant_pages: int):
        report = getattr(model, "_oscar_compile_report", None)
        if report is None:
            raise ValueError("CompressedRunner needs a model rewritten by oscar_compile.apply")
        if any(r.action != "rewritten" for r in report.layers):
            raise NotImplementedError(
                "layers overridden to 16 bits keep Hugging Face attention, which the paged runtime cannot batch; "
                "serve them rewritten (a bits: 16 override without rotation changes) or use LLM without a spec"
            )
        self.model = model
        # transformers renamed the forward's past_key_values to cache (5.2x): look it up once, not per step
        self.cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.num_layers = len(report.layers)
        self.vocab_size = model.config.get_text_config().vocab_size
        param = next(model.parameters())
        self.device, dtype = param.device, param.dtype
        self.pools = [self._layer_pools(layout, i, num_window_pages, num_quant_pages, dtype) for i in range(self.num_layers)]

    def _layer_pools(self, layout: CacheLayout, layer: int, num_window: int, num_quant: int, dtype) -> tuple:
        fmt = layout.format_of(layer)
        H, P, D = layout.num_kv_heads, layout.page_size, layout.head_dim
        if fmt.bits == 16:
            pages = torch.zeros(max(1, num_quant), H, P, D, dtype=dtype, device=self.device)
            return pages, torch.zeros_like(pages)
        return tuple(allocate_pools(max(1, num_quant), max(1, num_window), H, P, D, fmt.bits, fmt.group_size,
                                    fmt.scale_dtype, dtype, self.device))

    @torch.no_grad()
    def run(self, batch: Batch) -> torch.Tensor:
        ids = torch.tensor([[t for toks in batch.token_ids for t in toks]], device=self.device)
        positions = torch.tensor([[p for pos in batch.positions for p in pos]], device=self.device)
        cache = StepCache(self, batch, self.device)
        logits = self.model(input_ids=ids, position_ids=positions, use_cache=True, **{self.cache_kwarg: cache}).logits[0]
        last = cache.cu[1:].long() - 1  # each sequence's last new token
        return logits[last].float()


def runner_factory(model: torch.nn.Module, layout: CacheLayout):
    """``make_runner`` for ``build_engine``: pools sized from the block manager's page counts."""

    def make(block_manager) -> CompressedRunner:
        return CompressedRunner(model, layout, block_manager.window_pool.num_pages, block_manager.quant_pool.num_pages)

    return make


def compressed_layout(model: torch.nn.Module, spec) -> CacheLayout:
    """The runtime layout for a spec: INT-b history pages, or (every layer at 16 bits: the BF16
    mode) no windows and every token in a full-precision page."""
    config = model.config.get_text_config()
    dtype_bytes = torch.finfo(next(model.parameters()).dtype).bits // 8
    layout = CacheLayout.from_spec(spec, config, dtype_bytes=dtype_bytes)
    if layout.is_full_precision:
        return CacheLayout.bf16(layout.num_layers, layout.num_kv_heads, layout.head_dim,
                                page_size=spec.kv_cache.page_size, dtype_bytes=dtype_bytes)
    return layout
