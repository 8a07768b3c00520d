"""Throughput against TTFT p99 over the request rates, one curve per mode: where each mode's
latency turns up as the offered load grows. matplotlib is optional (``pip install
oscar-compile[bench]``); without it the plot is skipped and the caller says so.
"""

from __future__ import annotations

from pathlib import Path

from oscar_compile.bench.load_report import level_label, shown_figures


def curves(runs: list[dict]) -> dict[str, list[tuple[float, float, str]]]:
    """mode -> [(output tok/s, TTFT p99 ms, level label)] over its rate levels that have both figures."""
    out: dict[str, list[tuple[float, float, str]]] = {}
    for run in runs:
        points = []
        for level in run["levels"]:
            if level.get("request_rate") is None:
                continue
            _, f = shown_figures(level["summary"])
            if f["output_tokens_per_s"] is not None and f["ttft_ms"]["p99"] is not None:
                points.append((f["output_tokens_per_s"], f["ttft_ms"]["p99"], level_label(level)))
        if points:
            out[run.get("mode") or "server"] = points
    return out


def plot(runs: list[dict], path: Path, title: str = "") -> str:
    """Write the plot to ``path``; one line that says what happened."""
    lines = curves(runs)
    if not lines:
        return "no plot: no request-rate level with streamed requests (TTFT) and throughput"
    try:
        import matplotlib
    except ImportError:
        return "no plot: matplotlib is not installed (pip install oscar-compile[bench])"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, points in lines.items():
        xs, ys, labels = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", label=mode)
        for x, y, label in points:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("output tokens/s (steady state where the level has one)")
    ax.set_ylabel("TTFT p99 (ms)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
