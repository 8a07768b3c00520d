"""Prometheus text exposition of the engine's stats snapshot (format version 0.0.4).

Rendered by hand: a dozen gauges and counters do not justify a client-library dependency.
"""

from __future__ import annotations

# (name, type, help, stats key)
_SCALARS = (
    ("oscar_requests_waiting", "gauge", "Requests waiting for admission.", "num_waiting"),
    ("oscar_requests_running", "gauge", "Requests holding KV pages.", "num_running"),
    ("oscar_requests_finished_total", "counter", "Requests that ended (any reason).",
     "num_requests_finished"),
    ("oscar_requests_aborted_total", "counter", "Requests aborted (client gone or cancelled).",
     "num_requests_aborted"),
    ("oscar_preemptions_total", "counter", "Sequences preempted for lack of pages.", "num_preemptions"),
    ("oscar_prompt_tokens_total", "counter", "Prompt tokens received.", "prompt_tokens_total"),
    ("oscar_batched_tokens_total", "counter",
     "Tokens run through the model (prefill, recomputation and decode).", "batched_tokens_total"),
    ("oscar_generation_tokens_total", "counter", "Tokens generated.", "generation_tokens_total"),
    ("oscar_generation_tokens_per_second", "gauge",
     "Generated tokens per second over the last 10 s.", "generation_tokens_per_s"),
    ("oscar_prefix_cache_hit_rate", "gauge",
     "Share of admitted tokens served from the prefix cache.", "prefix_cache_hit_rate"),
    ("oscar_prefix_cache_queried_tokens_total", "counter",
     "Tokens looked up in the prefix cache at admission.", "prefix_cache_queried_tokens"),
    ("oscar_prefix_cache_hit_tokens_total", "counter",
     "Tokens found in the prefix cache at admission.", "prefix_cache_hit_tokens"),
    ("oscar_swap_preemptions_total", "counter",
     "Preemptions that swapped the sequence's pages to host memory.", "num_swap_preemptions"),
    ("oscar_recompute_preemptions_total", "counter",
     "Preemptions that freed the pages to recompute (swap space full, or still prefilling).",
     "num_recompute_preemptions"),
    ("oscar_swap_ins_total", "counter", "Swapped-out sequences copied back to the device.", "num_swap_ins"),
    ("oscar_requests_swapped", "gauge", "Sequences whose pages sit in host swap space.", "num_swapped"),
    ("oscar_swap_space_bytes", "gauge", "Host swap space.", "swap_space_bytes"),
    ("oscar_swap_space_used_bytes", "gauge", "Host swap space holding swapped-out pages.",
     "swap_space_used_bytes"),
    ("oscar_staged_prefills_total", "counter",
     "Prompts prefilled in chunks with their history staged in full precision.", "num_staged_prefills"),
    ("oscar_staging_pages_peak", "gauge", "Most staging pages in use at once.", "staging_pages_peak"),
)
# (name, help, kernels.jit_watch key): counters of Triton JIT compiles in this process
_JIT = (
    ("oscar_jit_compiles_total", "Triton kernel specializations compiled (or loaded from disk).",
     "jit_compiles_total"),
    ("oscar_jit_compiles_while_serving_total",
     "Compiles after startup: each one held the engine (the warmup missed its specialization).",
     "jit_compiles_while_serving"),
    ("oscar_jit_compile_seconds_while_serving_total", "Seconds the engine spent in those compiles.",
     "jit_compile_seconds_while_serving"),
)
# (name, help, stats key suffix); labelled by page kind
_PAGES = (
    ("oscar_kv_pages_total", "KV pages in the pool.", "pages_total"),
    ("oscar_kv_pages_used", "KV pages referenced by a sequence.", "pages_used"),
    ("oscar_kv_pages_cached", "Unreferenced KV pages kept for prefix reuse (evictable).",
     "pages_cached"),
    ("oscar_kv_pages_free", "KV pages holding nothing.", "pages_free"),
)
PAGE_KINDS = ("window", "quant", "staging")  # staging: full-precision history of chunked prefills


def render_metrics(stats: dict[str, float], ignored_fields: dict[str, int] | None = None) -> str:
    """``ignored_fields``: how many times the server ignored each unknown request field."""
    lines: list[str] = []
    # which oscar::attention kernel ran in this process (Gluon on sm_90 decode, the extend path for
    # prefill-like INT-b calls, Triton otherwise)
    from oscar_compile.kernels.attention_dispatch import kernels_in_use

    lines += ["# HELP oscar_attention_kernel_info The attention kernels that ran, and why each was chosen.",
              "# TYPE oscar_attention_kernel_info gauge"]
    lines += [f'oscar_attention_kernel_info{{kernel="{kernel}",reason="{_label(why)}"}} 1'
              for kernel, why in sorted(kernels_in_use().items())]
    for name, kind, help_text, key in _SCALARS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {_fmt(stats[key])}"]
    from oscar_compile.kernels.jit_watch import compile_stats

    jit = compile_stats()
    for name, help_text, key in _JIT:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {_fmt(jit[key])}"]
    for name, help_text, suffix in _PAGES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for page_kind in PAGE_KINDS:
            lines.append(f'{name}{{kind="{page_kind}"}} {_fmt(stats[f"{page_kind}_{suffix}"])}')
    lines += _rank_lines(stats)
    lines += ["# HELP oscar_ignored_request_fields_total Unknown request fields accepted and ignored, by field path "
              "(list indices as *; past 64 names or over 128 characters, field=\"(other)\").",
              "# TYPE oscar_ignored_request_fields_total counter"]
    lines += [f'oscar_ignored_request_fields_total{{field="{_label(field)}"}} {count}'
              for field, count in sorted((ignored_fields or {}).items())]
    return "\n".join(lines) + "\n"


def _rank_lines(stats: dict[str, float]) -> list[str]:
    """Per tensor-parallel rank: its KV pages (the same page ids on every rank, each holding that
    rank's KV heads) and the bytes of its pools. One rank when the model is not split."""
    num_ranks = int(stats.get("tensor_parallel_size", 1))
    lines = ["# HELP oscar_tensor_parallel_size Ranks the model is split over (one process per device).",
             "# TYPE oscar_tensor_parallel_size gauge", f"oscar_tensor_parallel_size {num_ranks}",
             "# HELP oscar_kv_rank_bytes KV pool memory held by each rank.", "# TYPE oscar_kv_rank_bytes gauge"]
    lines += [f'oscar_kv_rank_bytes{{rank="{r}"}} {_fmt(stats.get("kv_bytes_per_rank", 0))}' for r in range(num_ranks)]
    for suffix in ("pages_total", "pages_used"):
        name = f"oscar_kv_rank_{suffix}"
        lines += [f"# HELP {name} KV {suffix.replace('_', ' ')} on each rank (rank 0's plan: every rank holds the same "
                  "page ids, each with its own KV heads).", f"# TYPE {name} gauge"]
        lines += [f'{name}{{rank="{r}",kind="{kind}"}} {_fmt(stats[f"{kind}_{suffix}"])}'
                  for r in range(num_ranks) for kind in PAGE_KINDS]
    return lines


def _label(text: str) -> str:
    """A Prometheus label value: backslash, quote and newline escaped."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"
