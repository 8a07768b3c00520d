"""The engine's settings as frozen configs, one per room, and what a runner declares it can do.

vLLM v1 keeps ``VllmConfig`` as frozen sub-configs; so do we: ``CacheConfig`` (pages, prefix
hits, staging, swap), ``SchedulerConfig`` (batch limits) and ``RunnerConfig`` (how steps run).
Each default is written once, here: the CLI's flags, ``LLM(...)`` and the ``EngineConfig``
facade (engine_config.py) all fall back to these. A config is checked when it is made and never
changes afterwards, so the engine, the page manager and the runner can read it from any thread.

``RunnerCapabilities`` is the runner's typed declaration (``ModelRunner.capabilities``): what
``build_engine`` builds the page manager from, once, and what the engine reads to decide whether
steps overlap and which requests it can serve.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from oscar_compile.formats.cache import CacheLayout
from oscar_compile.formats.prefill import (
    DECODE_CONSISTENT,
    DEFAULT_PREFILL_SEMANTICS,
    PROMPT_EXACT,
    check_prefill_semantics,
)

DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# prefill and mixed steps of up to this many tokens replay piecewise CUDA graphs (worker/piecewise_graphs.py);
# a larger step's host work hides behind its GPU time (an 8B step of 8192 tokens: 92 of 259 ms on an H100)
DEFAULT_PIECEWISE_MAX_TOKENS = 2048
DEFAULT_SWAP_SPACE_GB = 4.0
PREFIX_HITS = ("history", "sink", "snapshot")


# the default share of the GPU an engine plans for (read when a CacheConfig is made: the GPU test
# session sets None, tests/conftest.py, where xdist workers' engines share one device)
GPU_MEMORY_UTILIZATION: float | None = 0.9


@dataclass(frozen=True)
class CacheConfig:
    """The KV pages and what may be shared between sequences.

    The page size is the cache format's (``layout.page_size``), not a knob here. Without a
    ``layout`` the engine keeps every token in 16-bit pages of ``CacheLayout.bf16``'s size.
    Page counts, when both given, override the memory budget (tests use them)."""

    layout: CacheLayout | None = None
    # the KV pages' budget, an absolute override; None: on CUDA what gpu_memory_utilization leaves
    # after a profile run (core/memory_plan.py), or half the free memory when that is None; on the
    # CPU 1 GiB (bookkeeping: no pages there)
    kv_memory_gb: float | None = None
    # the share of the GPU's memory the engine may fill: weights, the largest step, the pools and
    # the KV pages (vLLM's --gpu-memory-utilization and default, GPU_MEMORY_UTILIZATION); read on
    # CUDA when kv_memory_gb is None. None: no profile run, half the free memory after the weights
    # (the default before the plan passed its GPU test, tests/runtime/worker/test_memory_profile.py)
    gpu_memory_utilization: float | None = field(default_factory=lambda: GPU_MEMORY_UTILIZATION)
    num_window_pages: int | None = None
    num_quant_pages: int | None = None
    expected_seq_len: int | None = None  # sizes the window / quant split of the budget (page_plan.py)
    enable_prefix_caching: bool = True
    # "history": prefix-cache hits reuse sink and INT-b history pages (the continuation reads the
    # shared prefix quantized); "sink": hits stop at the sink, so a hit computes what a miss does;
    # "snapshot" (decode-consistent prefill only): hits past the sink resume at BF16 window
    # snapshots (core/window_snapshots.py), exact. None: "history" under prompt-exact prefill,
    # "snapshot" under decode-consistent prefill (resolved when the config is made)
    prefix_hits: str | None = None
    # tokens between the window snapshots of a sequence (besides the one at its prompt's end), a
    # multiple of the page size; None: twice the tokens whose INT-b history costs a snapshot's bytes
    snapshot_interval: int | None = None
    # what prompt tokens read from the cache (formats/prefill.py): "decode-consistent", the default
    # (as the decode step at their position reads it; no staging: chunked, batched and recomputed
    # prefills then equal the decode steps, and so do prefix hits at window snapshots), or
    # "prompt-exact" (full precision within the prompt, staged across chunks)
    prefill_semantics: str = DEFAULT_PREFILL_SEMANTICS
    # prompt-exact prefill only: full-precision staging of prompts prefilled in chunks (page_manager,
    # "Deferred demotion"), on top of the KV budget: None = room for the history of one prompt of the
    # context length; 0 = off (later chunks then read earlier ones back quantized).
    # num_staging_pages overrides it (tests). Decode-consistent prefill stages nothing.
    prefill_staging_memory_gb: float | None = None
    num_staging_pages: int | None = None
    swap_space_gb: float = DEFAULT_SWAP_SPACE_GB  # host memory preempted sequences swap to; 0 = recompute

    def __post_init__(self) -> None:
        if self.kv_memory_gb is not None and not self.kv_memory_gb > 0:
            raise ValueError(f"kv_memory_gb must be > 0, got {self.kv_memory_gb}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("prefill_staging_memory_gb", "num_staging_pages", "swap_space_gb"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if (self.num_window_pages is None) != (self.num_quant_pages is None):
            raise ValueError("give both num_window_pages and num_quant_pages, or neither")
        if self.snapshot_interval is not None and self.snapshot_interval < 1:
            raise ValueError(f"snapshot_interval must be >= 1, got {self.snapshot_interval}")
        decode_consistent = check_prefill_semantics(self.prefill_semantics) == DECODE_CONSISTENT
        if self.prefix_hits is None:  # frozen: the one resolution, when the config is made
            object.__setattr__(self, "prefix_hits", "snapshot" if decode_consistent else "history")
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

    @property
    def decode_consistent(self) -> bool:
        return self.prefill_semantics == DECODE_CONSISTENT


@dataclass(frozen=True)
class SchedulerConfig:
    """How much one step may hold. ``max_model_len`` None: the model's own context length."""

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class RunnerConfig:
    """How steps run on the device."""

    cuda_graphs: bool = True  # replay captured CUDA graphs for decode steps (compressed runner on a GPU)
    # with cuda_graphs, prefill and mixed steps of up to this many tokens replay piecewise graphs
    # (everything but attention, per padded token count; vLLM v1's); 0: they run eagerly
    piecewise_max_tokens: int = DEFAULT_PIECEWISE_MAX_TOKENS
    overlap_steps: bool = True  # host work of step n while step n + 1 runs (engine.py; compressed runner)
    # batch invariance and run-to-run determinism (kernels/determinism.py): batch-invariant linear
    # layers, attention split by a fixed number of tokens; vLLM's VLLM_BATCH_INVARIANT=1, SGLang's
    # --enable-deterministic-inference
    deterministic: bool = False
    # the base of the seeds of requests that give none (sampling_params.default_seed); vLLM's --seed
    seed: int = 0

    def __post_init__(self):
        if self.piecewise_max_tokens < 0:
            raise ValueError(f"piecewise_max_tokens must be >= 0 (0: no piecewise graphs), "
                             f"got {self.piecewise_max_tokens}")


@dataclass(frozen=True)
class RunnerCapabilities:
    """What a model runner does beyond ``run(batch)``; every field off unless the runner says so.

    - ``history_hits``: honours ``Batch.history_lens`` larger than ``max(0, L - W - S0)`` (a ring
      starting empty after a prefix hit); without it prefix hits stop at the sink (page_manager);
    - ``pending_tokens``: ``run(batch, pending_tokens)`` takes the previous step's samples from
      the device (``Batch.pending_rows``): the engine overlaps steps;
    - ``staging``: runs staged rows (``Batch.staging_tables``; deferred demotion, staging.py);
    - ``swapping``: ``swap(swap_out, swap_in)`` copies pages to host swap space and back;
    - ``prompt_logits``: returns every new token's logits of ``Batch.logit_rows`` (prompt logprobs);
    - ``page_copies``: ``copy_pages(copy)`` copies page contents (forked choices, ``n`` > 1, and
      window snapshots);
    - ``prefill_semantics``: what its prompt tokens read (formats/prefill.py);
    - ``tensor_parallel_size``: the ranks it runs on (each holds the same page ids).
    """

    history_hits: bool = False
    pending_tokens: bool = False
    staging: bool = False
    swapping: bool = False
    prompt_logits: bool = False
    page_copies: bool = False
    prefill_semantics: str = PROMPT_EXACT
    tensor_parallel_size: int = 1
