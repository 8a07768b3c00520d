"""The printed table of load levels, one row per level and mode (modes side by side under each level).

Figures are the steady state's (``load_metrics``) where the level has one ("over": steady, with
the requests counted of those sent in its window), else the whole level's ("over": all: e.g. rate
inf, where every request is sent at once).
"""

from __future__ import annotations

from oscar_compile.bench.load_metrics import STEADY_RULE


def level_label(level: dict) -> str:
    if level.get("request_rate") is not None:
        rate = level["request_rate"]
        burst = "" if level.get("burstiness", 1.0) == 1.0 else f" b{level['burstiness']:g}"
        return f"{rate:g} req/s{burst}"
    return f"conc {level['concurrency']}"


def shown_figures(summary: dict) -> tuple[str, dict]:
    steady = summary["steady"]
    return ("steady", steady) if steady["counted"] else ("all", summary)


def _cell(value, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _cells(dist: dict, keys: tuple[str, ...], fmt: str) -> str:
    return " / ".join(_cell(dist[k], fmt) for k in keys)


def row(level: dict) -> tuple[str, ...]:
    s = level["summary"]
    over, f = shown_figures(s)
    return (
        level.get("mode") or "-", level_label(level), str(s["requests"]), str(s["completed"]), str(s["disconnected"]),
        str(s["errors"]) + (f" {s['errors_by_kind']}" if s["errors"] else ""),
        over + (f" ({s['steady']['counted']}/{s['steady']['sent_in_window']})" if s["steady"]["window_s"] else ""),
        _cell(f["requests_per_s"], "{:.2f}"), _cell(f["output_tokens_per_s"]), _cell(f["total_tokens_per_s"]),
        _cells(f["ttft_ms"], ("p50", "p90", "p99"), "{:.1f}"), _cells(f["tpot_ms"], ("p50", "p99"), "{:.2f}"),
        _cells(f["itl_ms"], ("p50", "p99"), "{:.2f}"), _cells(f["latency_s"], ("p50", "p99"), "{:.2f}"),
        str(level["preemptions"]), f"{level['pages_in_use']['window']} / {level['pages_in_use']['quant']}",
    )


HEADER = ("mode", "level", "reqs", "done", "hung up", "errors", "over (n/sent)", "req/s", "out tok/s", "total tok/s",
          "TTFT p50/p90/p99 ms", "TPOT p50/p99 ms", "ITL p50/p99 ms", "lat p50/p99 s", "preempt", "pages used")


def table(levels: list[dict]) -> str:
    """Rows in the order given; ``side_by_side`` orders several modes' levels for it."""
    rows = [HEADER, *(row(level) for level in levels)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def side_by_side(runs: list[dict]) -> list[dict]:
    """Every run's levels, each level's modes next to each other (runs share their level list)."""
    return [run["levels"][i] for i in range(max((len(run["levels"]) for run in runs), default=0))
            for run in runs if i < len(run["levels"])]


def footer() -> str:
    return f"({STEADY_RULE}; over: all = the whole level, where it has no steady state)"
