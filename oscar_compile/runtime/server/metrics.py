"""``/metrics``: the Prometheus exposition, through ``prometheus_client``.

Each app owns a ``CollectorRegistry`` (``ServerMetrics``), so several apps in one process (the
tests) neither share nor collide. Two kinds of metric live in it:

- the engine's state, read at each scrape from the stats snapshot the engine thread publishes
  (plus the JIT compile counts, the attention kernels in use and the ignored request fields):
  ``SnapshotCollector`` builds gauge and counter families from it, so nothing is copied between
  scrapes;
- the request latency histograms, named and bucketed as vLLM's (``vllm:time_to_first_token_seconds``
  and so on, under ``oscar_``), labelled by ``model_name`` (the first served name), observed on
  the engine thread from each step's ``StepLatencies`` (runtime/latency.py says what each measures).

Every metric is listed, with its type, labels and meaning, in the README (section "Metrics").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from oscar_compile.runtime.latency import StepLatencies

# what generate_latest writes: the text format 0.0.4 (prometheus_client's CONTENT_TYPE_LATEST now
# says 1.0.0, which differs only for names outside [a-zA-Z0-9_:]; ours have none)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name, type, help, stats key)
_SCALARS = (
    ("oscar_requests_waiting", "gauge", "Sequences (one per choice) waiting for admission.", "num_waiting"),
    ("oscar_requests_running", "gauge", "Sequences (one per choice) holding KV pages.", "num_running"),
    ("oscar_requests_finished_total", "counter",
     "Requests that ended, any reason (a request is one prompt with its n choices; an HTTP request "
     "with several prompts counts once per prompt).", "num_requests_finished"),
    ("oscar_requests_aborted_total", "counter",
     "Requests (one per prompt) aborted: client gone, cancelled or timed out.", "num_requests_aborted"),
    ("oscar_preemptions_total", "counter", "Sequences (one per choice) preempted for lack of pages.",
     "num_preemptions"),
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
    ("oscar_window_snapshots_taken_total", "counter",
     "BF16 ring copies kept for exact prefix hits (decode-consistent prefill).", "window_snapshots_taken"),
    ("oscar_window_snapshot_hits_total", "counter",
     "Admissions that resumed at a window snapshot (a prefix hit past the sink, exact).", "window_snapshot_hits"),
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
    ("oscar_kv_pages_shared", "KV pages referenced by more than one sequence (prefix-cache hits, and the "
     "prompt pages the choices of an n > 1 request share).", "pages_shared"),
)
PAGE_KINDS = ("window", "quant", "staging")  # staging: full-precision history of chunked prefills

# vLLM's buckets (vllm/v1/metrics/loggers.py), in seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# (name, help, buckets, StepLatencies field)
_HISTOGRAMS = (
    ("oscar_time_to_first_token_seconds",
     "Histogram of time to first token in seconds, one per request (one prompt; arrival to its first "
     "output token).",
     TTFT_BUCKETS, "time_to_first_token"),
    ("oscar_inter_token_latency_seconds",
     "Histogram of inter-token latency in seconds, one per output token after a choice's first (between "
     "consecutive output tokens of one choice).",
     ITL_BUCKETS, "inter_token"),
    ("oscar_e2e_request_latency_seconds",
     "Histogram of e2e request latency in seconds, one per request (one prompt; arrival to its last "
     "choice's finish; aborted requests not counted).",
     REQUEST_LATENCY_BUCKETS, "e2e"),
    ("oscar_request_queue_time_seconds",
     "Histogram of time spent waiting in seconds, one per request (one prompt; arrival to first "
     "scheduled).",
     REQUEST_LATENCY_BUCKETS, "queue"),
)


class ServerMetrics:
    """One app's registry: the snapshot collector and the latency histograms.
    ``observe`` is a ``latency_observer`` of the async engine (called on its thread;
    prometheus_client's histograms take a lock per observation)."""

    def __init__(self, stats: Callable[[], dict[str, float]], ignored_fields: Callable[[], dict[str, int]],
                 model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(SnapshotCollector(stats, ignored_fields))
        self._histograms = [
            (Histogram(name, help_text, ["model_name"], buckets=buckets, registry=self.registry).labels(model_name),
             field)
            for name, help_text, buckets, field in _HISTOGRAMS]

    def observe(self, latencies: StepLatencies) -> None:
        for histogram, field in self._histograms:
            for seconds in getattr(latencies, field):
                histogram.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def render_metrics(stats: dict[str, float], ignored_fields: dict[str, int] | None = None) -> str:
    """The snapshot's metrics of ``stats`` alone (no histograms), as text: for tests of an engine
    without a server. ``ignored_fields``: how many times the server ignored each unknown field."""
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: stats, lambda: ignored_fields or {}))
    return generate_latest(registry).decode()


class SnapshotCollector:
    """Gauges and counters from the latest stats snapshot, built at each scrape."""

    def __init__(self, stats: Callable[[], dict[str, float]], ignored_fields: Callable[[], dict[str, int]]):
        self._stats, self._ignored_fields = stats, ignored_fields

    def collect(self) -> Iterator[Metric]:
        # which oscar::attention kernel ran in this process (Gluon on sm_90 decode, the extend path
        # for prefill-like INT-b calls, Triton otherwise)
        from oscar_compile.kernels.attention_dispatch import kernels_in_use
        from oscar_compile.kernels.jit_watch import compile_stats

        stats = self._stats()
        kernels = GaugeMetricFamily("oscar_attention_kernel_info",
                                    "The attention kernels that ran, and why each was chosen.",
                                    labels=["kernel", "reason"])
        for kernel, why in sorted(kernels_in_use().items()):
            kernels.add_metric([kernel, why], 1)
        yield kernels
        for name, kind, help_text, key in _SCALARS:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, help_text, value=stats[key])
        jit = compile_stats()
        for name, help_text, key in _JIT:
            yield CounterMetricFamily(name, help_text, value=jit[key])
        for name, help_text, suffix in _PAGES:
            pages = GaugeMetricFamily(name, help_text, labels=["kind"])
            for page_kind in PAGE_KINDS:
                pages.add_metric([page_kind], stats[f"{page_kind}_{suffix}"])
            yield pages
        forked = CounterMetricFamily(
            "oscar_forked_pages_total", "Pages the choices of n > 1 requests took when they forked from the prompt: "
            'shared by reference (how="shared") or copied on the device (how="copied").', labels=["kind", "how"])
        for kind in ("window", "quant"):
            for how in ("shared", "copied"):
                forked.add_metric([kind, how], stats[f"fork_{kind}_pages_{how}"])
        yield forked
        yield from _rank_metrics(stats)
        ignored = CounterMetricFamily(
            "oscar_ignored_request_fields_total",
            "Unknown request fields accepted and ignored, by field path (list indices as *; past 64 names "
            'or over 128 characters, field="(other)").', labels=["field"])
        for field, count in sorted(self._ignored_fields().items()):
            ignored.add_metric([field], count)
        yield ignored


def _rank_metrics(stats: dict[str, float]) -> Iterator[Metric]:
    """Per tensor-parallel rank: its KV pages (the same page ids on every rank, each holding that
    rank's KV heads) and the bytes of its pools. One rank when the model is not split."""
    num_ranks = int(stats.get("tensor_parallel_size", 1))
    yield GaugeMetricFamily("oscar_tensor_parallel_size", "Ranks the model is split over (one process per device).",
                            value=num_ranks)
    rank_bytes = GaugeMetricFamily("oscar_kv_rank_bytes", "KV pool memory held by each rank.", labels=["rank"])
    for r in range(num_ranks):
        rank_bytes.add_metric([str(r)], stats.get("kv_bytes_per_rank", 0))
    yield rank_bytes
    for suffix in ("pages_total", "pages_used"):
        family = GaugeMetricFamily(
            f"oscar_kv_rank_{suffix}", f"KV {suffix.replace('_', ' ')} on each rank (rank 0's plan: every rank "
            "holds the same page ids, each with its own KV heads).", labels=["rank", "kind"])
        for r in range(num_ranks):
            for kind in PAGE_KINDS:
                family.add_metric([str(r), kind], stats[f"{kind}_{suffix}"])
        yield family
