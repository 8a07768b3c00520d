"""PNG plots of a results dict. matplotlib is optional: without it the plots are skipped (logged)
and the table and JSON are written regardless."""
from __future__ import annotations

import logging
from pathlib import Path

from .layer_metrics import METRIC_TITLES, METRICS

logger = logging.getLogger(__name__)
MISSING = ("matplotlib is not installed: plots skipped (pip install matplotlib); "
           "results.md and results.json are complete")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_plots(results: dict, out_dir: Path) -> list[str]:
    """Write every plot the results have data for; returns the file paths (empty without matplotlib)."""
    plt = _pyplot()
    if plt is None:
        logger.warning(MISSING)
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for name, fn in (("by_context.png", _by_context), ("layers.png", _layers), ("needle.png", _needle)):
        fig = fn(plt, results)
        if fig is not None:
            path = out_dir / name
            fig.savefig(path, dpi=120, bbox_inches="tight")
            plt.close(fig)
            files.append(str(path))
    return files


def _by_context(plt, results: dict):
    """Perplexity, agreement and needle accuracy against context length, one line per method."""
    panels = [(task, key, label) for task, key, label in (
        ("perplexity", "ppl", "perplexity"), ("agreement", "agreement", "greedy agreement with BF16"))
        if task in results]
    needle = results.get("needle", {}).get("by_length")
    if not panels and not needle:
        return None
    fig, axes = plt.subplots(1, len(panels) + bool(needle), figsize=(5 * (len(panels) + bool(needle)), 4),
                             squeeze=False)
    for ax, (task, key, label) in zip(axes[0], panels, strict=False):  # the last axis may be the needle panel
        contexts = [c for c in results[task] if c.isdigit()]
        for name in results["methods"]:
            ax.plot([int(c) for c in contexts], [results[task][c][name][key] for c in contexts], marker="o", label=name)
        ax.set(xlabel="context length", ylabel=label, xscale="log", title=label)
        ax.set_xticks([int(c) for c in contexts], contexts)
    if needle:
        ax = axes[0][-1]
        for name, acc in needle.items():
            ax.plot([int(L) for L in acc], list(acc.values()), marker="o", label=name)
        lengths = sorted({int(L) for acc in needle.values() for L in acc})
        ax.set(xlabel="prompt length", ylabel="accuracy", xscale="log", ylim=(-0.02, 1.02), title="needle retrieval")
        ax.set_xticks(lengths, [str(L) for L in lengths])
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def _layers(plt, results: dict):
    """One panel per per-layer metric, log scale, one line per method (BF16's zeros are left out)."""

    per_method = results.get("layers", {}).get("metrics")
    if not per_method:
        return None
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, metric in zip(axes.flat, METRICS, strict=True):
        for name, layers in per_method.items():
            values = [layer[metric] for layer in layers]
            if any(v > 0 for v in values):
                ax.plot(range(len(values)), values, marker="o", label=name)
        ax.set(xlabel="layer", yscale="log", title=METRIC_TITLES[metric])
        ax.title.set_fontsize(9)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def _needle(plt, results: dict):
    """Accuracy heatmaps, depth (rows) by prompt length (columns), one per method."""
    nd = results.get("needle", {})
    cells = nd.get("cells")
    if not cells:
        return None
    lengths, depths = nd["lengths"], nd["depths"]
    n = len(cells)
    cols = min(n, 4)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.8 * rows), squeeze=False)
    image = None
    for ax, (name, method_cells) in zip(axes.flat, cells.items(), strict=False):  # spare axes: turned off below
        grid = [[float("nan")] * len(lengths) for _ in depths]
        for c in method_cells:
            grid[depths.index(c["depth"])][lengths.index(c["length"])] = c["correct"] / c["total"]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(L) for L in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        ax.set_title(name, fontsize=9)
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.supxlabel("prompt length")
    fig.supylabel("needle depth")
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, label="accuracy")
    return fig
