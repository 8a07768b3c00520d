"""Figures of one load level from its request records, and the printed table.

Definitions (the same for every level): throughput counts the output tokens of completed
requests (from the server's ``usage``) over the level's wall time; TTFT is the time from sending
a streamed request to its first event with text; inter-token latency is the gap between
successive events with text of one stream (one token each, except where the detokenizer held
text back, e.g. an incomplete UTF-8 character). Percentiles interpolate linearly.
"""

from __future__ import annotations

import math
from collections import Counter

from oscar_compile.bench.load_client import RequestRecord


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1e3


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    completed = [r for r in records if r.outcome == "completed"]
    ttfts = [r.ttft_s for r in records if r.stream and r.ttft_s is not None]
    gaps = [g for r in records if r.stream for g in r.inter_token_s()]
    latencies = [r.latency_s for r in completed]
    output_tokens = sum(r.num_output_tokens for r in completed)
    return {
        "requests": len(records),
        "completed": len(completed),
        "disconnected": sum(r.outcome == "disconnected" for r in records),
        "errors": sum(r.outcome == "error" for r in records),
        "errors_by_kind": dict(Counter(r.error for r in records if r.outcome == "error")),
        "streamed": sum(r.stream for r in records),
        "wall_s": wall_s,
        "output_tokens": output_tokens,
        "requested_output_tokens": sum(r.max_tokens for r in completed),  # equal: ignore_eos runs to max_tokens
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(completed) / wall_s if wall_s > 0 else None,
        "ttft_ms": {"p50": _ms(percentile(ttfts, 50)), "p99": _ms(percentile(ttfts, 99))},
        "itl_ms": {"p50": _ms(percentile(gaps, 50)), "p99": _ms(percentile(gaps, 99))},
        "latency_s": {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99)},
    }


def _cell(value, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def table(levels: list[dict]) -> str:
    header = ("conc", "reqs", "done", "hung up", "errors", "out tok/s", "req/s", "TTFT p50/p99 ms",
              "ITL p50/p99 ms", "lat p50/p99 s", "preempt", "pages used")
    rows = [header]
    for level in levels:
        s = level["summary"]
        rows.append((
            str(level["concurrency"]), str(s["requests"]), str(s["completed"]), str(s["disconnected"]),
            str(s["errors"]) + (f" {s['errors_by_kind']}" if s["errors"] else ""),
            _cell(s["output_tokens_per_s"]), _cell(s["requests_per_s"], "{:.2f}"),
            f"{_cell(s['ttft_ms']['p50'])} / {_cell(s['ttft_ms']['p99'])}",
            f"{_cell(s['itl_ms']['p50'], '{:.2f}')} / {_cell(s['itl_ms']['p99'], '{:.2f}')}",
            f"{_cell(s['latency_s']['p50'], '{:.2f}')} / {_cell(s['latency_s']['p99'], '{:.2f}')}",
            str(level["preemptions"]), f"{level['pages_in_use']['window']} / {level['pages_in_use']['quant']}",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
