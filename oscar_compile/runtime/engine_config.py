"""Assemble an engine around a loaded model: cache sizing, page plan, page manager, runner.

``EngineConfig`` is the one place the engine's settings are made (the CLI and ``LLM(...)`` both
build it): a facade over the frozen cache, scheduler and runner configs of core/config.py.
``build_engine`` reads the runner's declared capabilities first and builds the page manager once
from them. Shared by the offline ``LLM`` and the server so both size the cache the same way.
Loading a model and picking its device is ``oscar_compile.loading`` (its names are re-exported
here).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, replace

import torch

from oscar_compile.formats.cache import CacheLayout
from oscar_compile.formats.prefill import DECODE_CONSISTENT
from oscar_compile.loading import BUNDLED_MODEL_DIR, load_model, resolve_device, resolve_model_dir  # noqa: F401
from oscar_compile.runtime.core.config import (  # noqa: F401  (PREFIX_HITS re-exported)
    PREFIX_HITS,
    CacheConfig,
    RunnerCapabilities,
    RunnerConfig,
    SchedulerConfig,
)
from oscar_compile.runtime.core.memory_plan import check_override, checked_kv_bytes, largest_step, plan_memory, smallest
from oscar_compile.runtime.core.page_manager import PageManager
from oscar_compile.runtime.core.page_plan import GIB, plan_pages
from oscar_compile.runtime.core.swap_space import SwapSpace
from oscar_compile.runtime.core.window_snapshots import default_interval, history_tokens_per_snapshot
from oscar_compile.runtime.engine import LLMEngine
from oscar_compile.runtime.worker.runner import ModelRunner, RecomputeRunner, RunnerFactory

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}
_CPU_KV_MEMORY_GB = 1.0  # bookkeeping budget on CPU, where only the recompute runner exists
_GPU_KV_FRACTION = 0.5  # share of the GPU memory left free after the weights


_FIELDS = {name: sub for sub in (CacheConfig, SchedulerConfig, RunnerConfig) for name in sub.__dataclass_fields__}
_SUB = {CacheConfig: "cache", SchedulerConfig: "scheduler", RunnerConfig: "runner"}


@dataclass(frozen=True, init=False)
class EngineConfig:
    """The engine's three frozen configs (core/config.py), made in one place.

    ``EngineConfig(**kw)`` takes any field of ``CacheConfig``, ``SchedulerConfig`` or
    ``RunnerConfig`` by name (``EngineConfig(seed=1, prefix_hits="sink", deterministic=True)``)
    and routes it to its config, whose default applies otherwise; ``cache=``, ``scheduler=`` and
    ``runner=`` give whole configs (the flat keywords then replace their fields). A field reads
    back flat too (``config.max_num_seqs``). ``dataclasses.replace(config, layout=...)`` works:
    it passes the three configs and the change. An unknown keyword is a TypeError."""

    cache: CacheConfig
    scheduler: SchedulerConfig
    runner: RunnerConfig

    def __init__(self, *, cache: CacheConfig | None = None, scheduler: SchedulerConfig | None = None,
                 runner: RunnerConfig | None = None, **fields):
        unknown = sorted(set(fields) - set(_FIELDS))
        if unknown:
            raise TypeError(f"EngineConfig got unknown settings {unknown}")
        given = {CacheConfig: cache, SchedulerConfig: scheduler, RunnerConfig: runner}
        for kind, config in given.items():
            changes = {k: v for k, v in fields.items() if _FIELDS[k] is kind}
            if config is None:
                config = kind(**changes)
            elif changes:
                config = dataclasses.replace(config, **changes)
            object.__setattr__(self, _SUB[kind], config)
        if self.runner.deterministic and self.scheduler.max_num_batched_tokens < 3:
            raise ValueError("deterministic mode needs max_num_batched_tokens >= 3 (prompt chunks of 2 tokens or more, "
                             f"PageManager(deterministic=True)), got {self.scheduler.max_num_batched_tokens}")

    def __getattr__(self, name: str):
        kind = _FIELDS.get(name)
        if kind is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, _SUB[kind]), name)


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
    """The budget without a profile run: 1 GiB of bookkeeping on the CPU (the recompute runner
    allocates no pages); on CUDA, for a runner given whole or one without pools (no factory to
    profile), half the free memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * _GPU_KV_FRACTION)
    return int(_CPU_KV_MEMORY_GB * GIB)


def num_staging_pages(cache: CacheConfig, layout: CacheLayout, num_quant_pages: int, max_model_len: int) -> int:
    """Staging pages (full precision, all layers: ``layout.window_page_bytes`` each) the config asks for."""
    if cache.num_staging_pages is not None:
        return cache.num_staging_pages
    if cache.prefill_staging_memory_gb is not None:
        return int(cache.prefill_staging_memory_gb * GIB) // layout.window_page_bytes
    longest = min(max_model_len, num_quant_pages * layout.page_size + layout.sink + layout.recent)
    return layout.num_quant_pages_for(layout.num_history_tokens(longest))


def _layout(model, cache: CacheConfig) -> CacheLayout:
    text_config = model.config.get_text_config()
    return cache.layout or CacheLayout.bf16(
        text_config.num_hidden_layers,
        getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads,
        getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads,
        dtype_bytes=_DTYPE_BYTES.get(model.dtype, 2))


def _page_counts(config: EngineConfig, layout: CacheLayout, max_model_len: int, device: torch.device,
                 capabilities: RunnerCapabilities, make_runner: RunnerFactory | None, model=None) -> tuple[int, int]:
    """(window, quant) pages: the config's counts, else the plan of a budget: ``kv_memory_gb``
    (an absolute override; on CUDA checked against a profile run of the runner ``make_runner``
    builds, :func:`checked_kv_override`), else on CUDA what ``gpu_memory_utilization`` (when set)
    leaves after that profile run (:func:`planned_kv_bytes`), else the default
    (:func:`default_kv_memory_bytes`)."""
    cache = config.cache
    if cache.num_window_pages is not None:
        return cache.num_window_pages, cache.num_quant_pages
    profiled = device.type == "cuda" and make_runner is not None
    if cache.kv_memory_gb is not None:
        kv_bytes = int(cache.kv_memory_gb * GIB)
        if profiled:
            checked_kv_override(kv_bytes, config, layout, max_model_len, device, capabilities, make_runner, model)
    elif profiled and cache.gpu_memory_utilization is not None:
        kv_bytes = planned_kv_bytes(config, layout, max_model_len, device, capabilities, make_runner, model)
    else:
        kv_bytes = default_kv_memory_bytes(device)
    plan = plan_pages(layout, kv_bytes, config.scheduler.max_num_seqs,
                      cache.expected_seq_len or min(max_model_len, 4096))
    return plan.num_window_pages, plan.num_quant_pages


def later_pool_bytes(cache: CacheConfig, layout: CacheLayout, capabilities: RunnerCapabilities,
                     max_model_len: int) -> dict[str, int]:
    """Device bytes the runner allocates beside the KV budget's pages (the most, whatever the
    budget): its staging pages (prompt-exact prefill: the history of one prompt of the context
    length, or the config's size) and the scratch page of each pool (one window, one quant and
    one staging page). Window snapshots live in window pages: nothing beside the budget."""
    num_quant = layout.num_quant_pages_for(layout.num_history_tokens(max_model_len))
    staging = (num_staging_pages(cache, layout, num_quant, max_model_len)
               if capabilities.staging and not cache.decode_consistent else 0)
    scratch = layout.window_page_bytes + layout.quant_page_bytes + (layout.window_page_bytes if staging else 0)
    return {"staging pages": staging * layout.window_page_bytes, "scratch pages": scratch}


def planned_kv_bytes(config: EngineConfig, layout: CacheLayout, max_model_len: int, device: torch.device,
                     capabilities: RunnerCapabilities, make_runner: RunnerFactory, model=None) -> int:
    """The KV budget a profile run leaves (core/memory_plan.py): a runner over one sequence of
    ``max_model_len`` tokens runs the largest step on every device; the smallest remainder
    wins; InsufficientMemoryError when it cannot hold one such sequence. ``model``: the loaded
    model (its weights count as the engine's own; a factory that profiles itself measures them)."""
    cache = config.cache
    plans, later, one_seq = _profile_plans(config, layout, max_model_len, device, capabilities, make_runner, model,
                                           cache.gpu_memory_utilization)
    kv_bytes = checked_kv_bytes(plans, one_seq, f"one sequence of max_model_len {max_model_len}")
    plan = smallest(plans)
    logger.info("GPU memory plan: %.2f GiB of %.2f GiB (gpu_memory_utilization %g); weights and the largest step "
                "%.2f GiB, pools beside the pages %.2f GiB: %.2f GiB for the KV pages", plan.requested / GIB,
                plan.total / GIB, plan.utilization, plan.own / GIB, sum(later.values()) / GIB, kv_bytes / GIB)
    return kv_bytes


def checked_kv_override(kv_bytes: int, config: EngineConfig, layout: CacheLayout, max_model_len: int,
                        device: torch.device, capabilities: RunnerCapabilities, make_runner: RunnerFactory,
                        model=None) -> None:
    """``kv_bytes`` (``kv_memory_gb``) on CUDA: the same profile run, and InsufficientMemoryError (with what
    fits) when a device cannot hold those pages beside the weights, the largest step and the
    pools beside the pages (unchecked, a 60 GiB budget beside an 8B model and 8192-token steps
    ran out of memory capturing graphs on an 80 GB H100)."""
    plans, later, _ = _profile_plans(config, layout, max_model_len, device, capabilities, make_runner, model, 1.0)
    check_override(plans, kv_bytes)
    plan = max(plans, key=lambda p: (p.non_kv + p.others, p.rank))
    logger.info("GPU memory check: --kv-memory %.2f GiB beside the weights and the largest step (%.2f GiB) and the "
                "pools beside the pages (%.2f GiB): %.2f GiB of the %.2f GiB free for this engine", kv_bytes / GIB,
                plan.own / GIB, sum(later.values()) / GIB, (plan.non_kv + kv_bytes) / GIB, plan.free_for_engine / GIB)


def _profile_plans(config: EngineConfig, layout: CacheLayout, max_model_len: int, device: torch.device,
                   capabilities: RunnerCapabilities, make_runner: RunnerFactory, model,
                   utilization: float) -> tuple[list, dict[str, int], int]:
    """(one MemoryPlan per device, the pools beside the pages, one max_model_len sequence's page
    bytes) from a profile run of the largest step on a runner of one such sequence."""
    from oscar_compile.runtime.worker.memory_profile import measure_step_memory, weight_bytes

    cache = config.cache
    num_window, num_quant = layout.num_pages_for_seq(max_model_len)
    probe = build_page_manager(replace(cache, swap_space_gb=0.0), layout, capabilities, num_window,
                               max(1, num_quant), max_model_len, config.runner.deterministic)
    rows = largest_step(config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens,
                        min(max_model_len, probe.max_seq_len()))
    if make_runner.profile is not None:
        profiles = make_runner.profile(probe, rows)
    else:
        profiles = [measure_step_memory(lambda: make_runner(probe), rows, device, weight_bytes(model, device),
                                        score_prompts=capabilities.prompt_logits)]
    later = later_pool_bytes(cache, layout, capabilities, max_model_len)
    plans = [plan_memory(p, utilization, later, rank=i) for i, p in enumerate(profiles)]
    return plans, later, num_window * layout.window_page_bytes + num_quant * layout.quant_page_bytes


def build_page_manager(cache: CacheConfig, layout: CacheLayout, capabilities: RunnerCapabilities,
                       num_window: int, num_quant: int, max_model_len: int, deterministic: bool) -> PageManager:
    """The page manager for a runner of ``capabilities``, built once: staging, swap space, history
    hits and window snapshots only where the runner can serve them."""
    # decode-consistent prefill reads earlier chunks quantized, as decode does: nothing to stage
    num_staging = (num_staging_pages(cache, layout, num_quant, max_model_len)
                   if capabilities.staging and not cache.decode_consistent else 0)
    logger.info("KV pages: %d window (%d B each), %d quant (%d B each), %d staging (%d B each)", num_window,
                layout.window_page_bytes, num_quant, layout.quant_page_bytes, num_staging, layout.window_page_bytes)
    swap = SwapSpace(int(cache.swap_space_gb * GIB), layout.window_page_bytes, layout.quant_page_bytes)
    history_hits = cache.prefix_hits == "history" and capabilities.history_hits
    snapshot_interval = None
    if cache.prefix_hits == "snapshot" and cache.enable_prefix_caching:
        # exact hits past the sink: window snapshots where there is a ring; without one (the BF16
        # mode) every hit is a standard state, hence exact already
        if not layout.recent:
            history_hits = capabilities.history_hits
        elif capabilities.page_copies:
            snapshot_interval = cache.snapshot_interval or default_interval(layout)
    page_manager = PageManager(layout, num_window, num_quant, cache.enable_prefix_caching, history_hits=history_hits,
                               num_staging_pages=num_staging,
                               swap_space=swap if swap.num_bytes and capabilities.swapping else None,
                               snapshot_interval=snapshot_interval, deterministic=deterministic)
    if page_manager.snapshots is not None:
        logger.info("window snapshots every %d tokens and at each prompt's end: %d B each (the history of %.0f "
                    "tokens)", snapshot_interval, page_manager.snapshots.snapshot_bytes,
                    history_tokens_per_snapshot(layout))
    return page_manager


def build_engine(model, tokenizer, config: EngineConfig | None = None,
                 runner: ModelRunner | None = None, make_runner: RunnerFactory | None = None) -> LLMEngine:
    """An engine over ``model``.

    The runner is ``runner``, else ``make_runner(page_manager)`` (a ``RunnerFactory``: a runner
    that allocates its pools from the page counts, e.g. the compressed one, with the capabilities
    it will have), else the exact RecomputeRunner. The page manager is built once, from those
    capabilities.
    """
    config = config or EngineConfig()
    if make_runner is not None and not isinstance(make_runner, RunnerFactory):
        raise TypeError("make_runner must be a RunnerFactory (worker/runner.py): the capabilities of the runner it "
                        "builds, and build(page_manager)")
    capabilities = (runner.capabilities if runner is not None else make_runner.capabilities
                    if make_runner is not None else RecomputeRunner.capabilities)
    quantizes = config.layout is not None and not config.layout.is_full_precision  # else both semantics agree
    if config.cache.decode_consistent and quantizes and capabilities.prefill_semantics != DECODE_CONSISTENT:
        name = type(runner).__name__ if runner is not None else "this runner"
        raise NotImplementedError(f"{name} does not run decode-consistent prefill, the default (the "
                                  "compressed runner built from this config does: runner_factory(compressed, layout, "
                                  "config)); or ask for EngineConfig(prefill_semantics='prompt-exact')")
    layout = _layout(model, config.cache)
    max_model_len = config.scheduler.max_model_len or model.config.get_text_config().max_position_embeddings
    num_window, num_quant = _page_counts(config, layout, max_model_len, next(model.parameters()).device,
                                         capabilities, None if runner is not None else make_runner, model)
    page_manager = build_page_manager(config.cache, layout, capabilities, num_window, num_quant, max_model_len,
                                      config.runner.deterministic)
    if runner is None:
        runner = make_runner(page_manager) if make_runner is not None else RecomputeRunner(
            model, deterministic=config.runner.deterministic)
        if runner.capabilities != capabilities:
            raise ValueError(f"the runner built has {runner.capabilities}, its factory declared {capabilities}")
    return LLMEngine(runner, tokenizer, page_manager, replace(config.scheduler, max_model_len=max_model_len),
                     config.runner, eos_token_ids(model, tokenizer))
