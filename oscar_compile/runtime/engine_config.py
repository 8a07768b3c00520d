"""Assemble an engine around a loaded model: cache sizing, page plan, block manager, runner.

Shared by the offline ``LLM`` and the server so both size the cache the same way. Loading a
model and picking its device is ``oscar_compile.loading`` (its names are re-exported here).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from oscar_compile.formats.cache import CacheLayout
from oscar_compile.formats.prefill import (
    DECODE_CONSISTENT,
    DEFAULT_PREFILL_SEMANTICS,
    PROMPT_EXACT,
    check_prefill_semantics,
)
from oscar_compile.loading import BUNDLED_MODEL_DIR, load_model, resolve_device, resolve_model_dir  # noqa: F401
from oscar_compile.runtime.core.page_manager import PageManager
from oscar_compile.runtime.core.page_plan import GIB, plan_pages
from oscar_compile.runtime.core.page_pool import PagePool
from oscar_compile.runtime.core.swap_space import SwapSpace
from oscar_compile.runtime.core.window_snapshots import WindowSnapshots, default_interval, history_tokens_per_snapshot
from oscar_compile.runtime.engine import LLMEngine
from oscar_compile.runtime.worker.runner import ModelRunner, RecomputeRunner

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}
_CPU_KV_MEMORY_GB = 1.0  # bookkeeping budget on CPU, where only the recompute runner exists
_GPU_KV_FRACTION = 0.5  # share of the GPU memory left free after the weights
PREFIX_HITS = ("history", "sink", "snapshot")  # EngineConfig.prefix_hits


@dataclass
class EngineConfig:
    """Serving knobs. Page counts, when both given, override the memory budget (tests use it).

    The page size is the cache format's (``layout.page_size``, from the spec's
    ``kv_cache.page_size``), not a knob here: the windows are whole pages of it and the graphs
    were rewritten for it. Without a ``layout`` the engine keeps every token in 16-bit pages of
    ``CacheLayout.bf16``'s default size."""

    kv_memory_gb: float | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    expected_seq_len: int | None = None
    enable_prefix_caching: bool = True
    layout: CacheLayout | None = None
    num_window_pages: int | None = None
    num_quant_pages: int | None = None
    cuda_graphs: bool = True  # replay captured CUDA graphs for decode steps (compressed runner on a GPU)
    overlap_steps: bool = True  # host work of step n while step n + 1 runs (engine.py; compressed runner)
    # prompt-exact prefill only: full-precision staging of prompts prefilled in chunks (page_manager,
    # "Deferred demotion"), on top of the KV budget: None = room for the history of one prompt of the
    # context length; 0 = off (later chunks then read earlier ones back quantized).
    # num_staging_pages overrides it (tests). Decode-consistent prefill stages nothing.
    prefill_staging_memory_gb: float | None = None
    num_staging_pages: int | None = None
    swap_space_gb: float = 4.0  # host memory preempted sequences swap to (pinned on CUDA); 0 = recompute
    # "history": prefix-cache hits reuse sink and INT-b history pages (the continuation reads the
    # shared prefix quantized); "sink": hits stop at the sink, so a hit computes what a miss does;
    # "snapshot" (decode-consistent prefill only): hits past the sink resume at BF16 window
    # snapshots (runtime/core/window_snapshots.py), exact. None: "history" under prompt-exact
    # prefill, "snapshot" under decode-consistent prefill
    prefix_hits: str | None = None
    # tokens between the window snapshots of a sequence (besides the one at its prompt's end), a
    # multiple of the page size; None: twice the tokens whose INT-b history costs a snapshot's bytes
    snapshot_interval: int | None = None
    # what prompt tokens read from the cache (formats/prefill.py): "decode-consistent", the default
    # (as the decode step at their position reads it; no staging: chunked, batched and recomputed
    # prefills then equal the decode steps, and so do prefix hits at window snapshots), or
    # "prompt-exact" (full precision within the prompt, staged across chunks)
    prefill_semantics: str = DEFAULT_PREFILL_SEMANTICS
    # the base of the seeds of requests that give none (sampling_params.default_seed); vLLM's --seed
    seed: int = 0
    # batch invariance and run-to-run determinism (kernels/determinism.py): batch-invariant linear
    # layers, attention split by a fixed number of tokens; vLLM's VLLM_BATCH_INVARIANT=1, SGLang's
    # --enable-deterministic-inference
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.kv_memory_gb is not None and not self.kv_memory_gb > 0:
            raise ValueError(f"kv_memory_gb must be > 0, got {self.kv_memory_gb}")
        for name in ("prefill_staging_memory_gb", "num_staging_pages", "swap_space_gb"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.deterministic and self.max_num_batched_tokens < 3:
            raise ValueError("deterministic mode needs max_num_batched_tokens >= 3 (prompt chunks of 2 tokens or more, "
                             f"PageManager.make_deterministic), got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        decode_consistent = check_prefill_semantics(self.prefill_semantics) == DECODE_CONSISTENT
        if self.prefix_hits is None:
            self.prefix_hits = "snapshot" if decode_consistent else "history"
        if self.prefix_hits not in PREFIX_HITS:
            raise ValueError(f"prefix_hits must be one of {PREFIX_HITS}, got {self.prefix_hits!r}")
        if decode_consistent and self.prefix_hits == "history":
            raise NotImplementedError("prefix_hits='history' with decode-consistent prefill: a hit past the sink "
                                      "would read its window from the quantized history, where a miss reads it at "
                                      "window precision; use 'snapshot' (hits at BF16 window snapshots, exact) "
                                      "or 'sink'")
        if not decode_consistent and self.prefix_hits == "snapshot":
            raise NotImplementedError("prefix_hits='snapshot' needs decode-consistent prefill: under prompt-exact "
                                      "prefill a miss reads the whole prompt at full precision, so no window "
                                      "snapshot makes a hit exact; use 'history' or 'sink'")
        if self.snapshot_interval is not None and self.snapshot_interval < 1:
            raise ValueError(f"snapshot_interval must be >= 1, got {self.snapshot_interval}")
        if (self.num_window_pages is None) != (self.num_quant_pages is None):
            raise ValueError("give both num_window_pages and num_quant_pages, or neither")


def _enable_snapshots(page_manager: PageManager, runner: ModelRunner, interval: int | None) -> None:
    """Exact hits past the sink (``prefix_hits="snapshot"``): window snapshots where there is a
    ring; without one (the BF16 mode) every hit is a standard state, hence exact already."""
    layout = page_manager.layout
    if not layout.recent:
        page_manager.history_hits = bool(getattr(runner, "supports_history_hits", False))
    elif hasattr(runner, "copy_pages"):
        interval = interval if interval is not None else default_interval(layout)
        page_manager.snapshots = WindowSnapshots(layout, page_manager.window_pool, interval)
        logger.info("window snapshots every %d tokens and at each prompt's end: %d B each (the history of %.0f "
                    "tokens)", interval, page_manager.snapshots.snapshot_bytes, history_tokens_per_snapshot(layout))


def eos_token_ids(model, tokenizer) -> list[int]:
    """EOS ids from the generation config and the tokenizer (models often list several)."""
    ids: set[int] = set()
    gen_config = getattr(model, "generation_config", None)
    for value in (getattr(gen_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return sorted(ids)


def default_kv_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * _GPU_KV_FRACTION)
    return int(_CPU_KV_MEMORY_GB * GIB)


def num_staging_pages(config: EngineConfig, layout: CacheLayout, num_quant_pages: int, max_model_len: int) -> int:
    """Staging pages (full precision, all layers: ``layout.window_page_bytes`` each) the config asks for."""
    if config.num_staging_pages is not None:
        return config.num_staging_pages
    if config.prefill_staging_memory_gb is not None:
        return int(config.prefill_staging_memory_gb * GIB) // layout.window_page_bytes
    longest = min(max_model_len, num_quant_pages * layout.page_size + layout.sink + layout.recent)
    return layout.num_quant_pages_for(layout.num_history_tokens(longest))


def build_engine(model, tokenizer, config: EngineConfig | None = None,
                 runner: ModelRunner | None = None,
                 make_runner: Callable[[PageManager], ModelRunner] | None = None) -> LLMEngine:
    """An engine over ``model``.

    The runner is ``runner``, else ``make_runner(page_manager)`` (a runner that allocates its
    pools from the page counts, e.g. the compressed one), else the exact RecomputeRunner.
    """
    config = config or EngineConfig()
    text_config = model.config.get_text_config()
    device = next(model.parameters()).device
    layout = config.layout or CacheLayout.bf16(
        text_config.num_hidden_layers,
        getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads,
        getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads,
        dtype_bytes=_DTYPE_BYTES.get(model.dtype, 2))
    max_model_len = config.max_model_len or text_config.max_position_embeddings
    if config.num_window_pages is not None:
        num_window, num_quant = config.num_window_pages, config.num_quant_pages
    else:
        kv_bytes = (int(config.kv_memory_gb * GIB) if config.kv_memory_gb is not None
                    else default_kv_memory_bytes(device))
        expected = config.expected_seq_len or min(max_model_len, 4096)
        plan = plan_pages(layout, kv_bytes, config.max_num_seqs, expected)
        num_window, num_quant = plan.num_window_pages, plan.num_quant_pages
    # decode-consistent prefill reads earlier chunks quantized, as decode does: nothing to stage
    decode_consistent = config.prefill_semantics == DECODE_CONSISTENT
    num_staging = 0 if decode_consistent else num_staging_pages(config, layout, num_quant, max_model_len)
    logger.info("KV pages: %d window (%d B each), %d quant (%d B each), %d staging (%d B each)", num_window,
                layout.window_page_bytes, num_quant, layout.quant_page_bytes, num_staging, layout.window_page_bytes)
    swap = SwapSpace(int(config.swap_space_gb * GIB), layout.window_page_bytes, layout.quant_page_bytes)
    page_manager = PageManager(layout, num_window, num_quant, config.enable_prefix_caching,
                                 num_staging_pages=num_staging, swap_space=swap if swap.num_bytes else None)
    if runner is None:
        runner = make_runner(page_manager) if make_runner is not None else RecomputeRunner(
            model, deterministic=config.deterministic)
    quantizes = config.layout is not None and not config.layout.is_full_precision  # else both semantics agree
    if decode_consistent and quantizes and getattr(runner, "prefill_semantics", PROMPT_EXACT) != DECODE_CONSISTENT:
        raise NotImplementedError(f"{type(runner).__name__} does not run decode-consistent prefill, the default (the "
                                  "compressed runner built from this config does: runner_factory(model, layout, "
                                  "config)); or ask for EngineConfig(prefill_semantics='prompt-exact')")
    page_manager.history_hits = (config.prefix_hits == "history"
                                  and bool(getattr(runner, "supports_history_hits", False)))
    if config.prefix_hits == "snapshot" and config.enable_prefix_caching:
        _enable_snapshots(page_manager, runner, config.snapshot_interval)
    if config.deterministic:
        page_manager.make_deterministic()
    if not getattr(runner, "supports_staging", False):  # e.g. the exact RecomputeRunner: nothing to stage
        page_manager.staging_pool = PagePool("staging", 0)
    if not getattr(runner, "supports_swapping", False):
        page_manager.swap_space = None
    return LLMEngine(runner, tokenizer, page_manager, max_model_len,
                     config.max_num_seqs, config.max_num_batched_tokens, eos_token_ids(model, tokenizer),
                     overlap=config.overlap_steps, seed=config.seed)
