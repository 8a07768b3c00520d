"""Figures of one load level from its request records: over the whole level, and over its steady state.

Definitions (the same for every level and mode):

- throughput: requests/s and output tokens/s count completed requests (output tokens from the
  server's ``usage``); total tokens/s adds their prompt tokens;
- TTFT: from sending a streamed request to its first event with text;
- TPOT: per completed stream, (end - first token) / (output tokens - 1), as ``vllm bench serve``;
- ITL: every gap between successive events with text of one stream (one token each, except
  where the detokenizer held text back, e.g. an incomplete UTF-8 character);
- latency: from sending to the end of a completed request.

Means and percentiles (p50, p90, p99; linear interpolation) are over the requests (TTFT, TPOT,
latency) or gaps (ITL) that count.

The steady state leaves out the warm-up and the drain. Its window runs from ``skip_s`` after
the level's first request to its last request (the last arrival: after it the offered load only
falls). Throughput in it counts the requests that completed inside the window, over the
window's length; latencies count the requests that were sent inside the window and ended
inside it. ``skip_s`` defaults to 10 % of the level's sending span. A level whose requests
are all sent at once (rate inf) has no steady state. A level over the server's capacity leaves
many of the requests sent in the window out (they end in the drain): ``sent_in_window`` beside
``counted`` shows how many.
"""

from __future__ import annotations

import math
from collections import Counter

from oscar_compile.bench.load_client import RequestRecord

STEADY_RULE = ("steady state: the window runs from skip_s after the level's first request to its last request "
               "(warm-up and drain left out); throughput = requests completed inside the window / its length; "
               "latencies = requests sent inside the window that also ended inside it")
DEFAULT_SKIP_SHARE = 0.1


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    """Mean, p50, p90, p99 of ``values`` times ``scale`` (None where there are none)."""
    scaled = [v * scale for v in values]
    return {"mean": sum(scaled) / len(scaled) if scaled else None,
            **{f"p{q}": percentile(scaled, q) for q in (50, 90, 99)}}


def tpot_s(record: RequestRecord) -> float | None:
    if record.outcome != "completed" or not record.event_times or record.num_output_tokens < 2:
        return None
    return (record.end - record.event_times[0]) / (record.num_output_tokens - 1)


def latency_figures(records: list[RequestRecord]) -> dict:
    streams = [r for r in records if r.stream]
    tpots = [t for r in streams if (t := tpot_s(r)) is not None]
    return {
        "ttft_ms": distribution([r.ttft_s for r in streams if r.ttft_s is not None], 1e3),
        "tpot_ms": distribution(tpots, 1e3),
        "itl_ms": distribution([g for r in streams for g in r.inter_token_s()], 1e3),
        "latency_s": distribution([r.latency_s for r in records if r.outcome == "completed"]),
    }


def throughput(completed: list[RequestRecord], seconds: float) -> dict:
    output = sum(r.num_output_tokens for r in completed)
    total = output + sum(r.num_prompt_tokens for r in completed)
    ok = seconds > 0
    return {"requests_per_s": len(completed) / seconds if ok else None,
            "output_tokens_per_s": output / seconds if ok else None,
            "total_tokens_per_s": total / seconds if ok else None}


def steady_window(starts: list[float], skip_s: float | None = None) -> tuple[float, float] | None:
    """(from, to) in the records' clock, or None when the window is empty."""
    if not starts:
        return None
    first, last = min(starts), max(starts)
    skip = DEFAULT_SKIP_SHARE * (last - first) if skip_s is None else skip_s
    return (first + skip, last) if first + skip < last else None


def steady_figures(records: list[RequestRecord], skip_s: float | None = None) -> dict:
    """The figures over the steady state (see the module docstring), or why there are none."""
    starts = [r.start for r in records]
    window = steady_window(starts, skip_s)
    if window is None:
        return {"window_s": None, "sent_in_window": 0, "counted": 0,
                "reason": "no steady state: the level's requests were all sent within skip_s of the first"}
    lo, hi = window
    first = min(starts)
    finished = [r for r in records if r.outcome == "completed" and lo <= r.end <= hi]
    sent = [r for r in records if lo <= r.start]
    counted = [r for r in sent if r.end <= hi]
    # sent_in_window - counted: requests left out because they ended in the drain (many: the level was
    # over capacity, and the latencies counted are the early, fast ones)
    none = {} if counted else {"reason": "no request was both sent and ended inside the window (a level too "
                                         "short for its latencies, or over capacity)"}
    return {"window_s": [lo - first, hi - first], "sent_in_window": len(sent), "counted": len(counted),
            "completed_in_window": len(finished), **none,
            **throughput(finished, hi - lo), **latency_figures(counted)}


def summarize(records: list[RequestRecord], wall_s: float, skip_s: float | None = None) -> dict:
    """The whole level's counts and figures, and ``steady``: the same over its steady state."""
    completed = [r for r in records if r.outcome == "completed"]
    return {
        "requests": len(records),
        "completed": len(completed),
        "disconnected": sum(r.outcome == "disconnected" for r in records),
        "errors": sum(r.outcome == "error" for r in records),
        "errors_by_kind": dict(Counter(r.error for r in records if r.outcome == "error")),
        "error_examples": {r.error: r.detail for r in reversed(records) if r.outcome == "error" and r.detail},
        "streamed": sum(r.stream for r in records),
        "wall_s": wall_s,
        "prompt_tokens": sum(r.num_prompt_tokens for r in completed),
        "output_tokens": sum(r.num_output_tokens for r in completed),
        "requested_output_tokens": sum(r.max_tokens for r in completed),  # equal: ignore_eos runs to max_tokens
        **throughput(completed, wall_s),
        **latency_figures(records),
        "steady": steady_figures(records, skip_s),
    }
