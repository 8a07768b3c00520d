"""The results as files: ``results.json`` (everything), ``results.md`` (tables), PNG plots."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from .layer_metrics import METRIC_TITLES, METRICS

logger = logging.getLogger(__name__)

def write_outputs(results: dict, out_dir: Path) -> list[str]:
    """Write JSON, markdown and (when matplotlib is installed) plots; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    from .plots import write_plots

    files = write_plots(results, out_dir)
    results["plots"] = [Path(f).name for f in files]
    (out_dir / "results.md").write_text(markdown(results))
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    return [str(out_dir / "results.json"), str(out_dir / "results.md"), *files]


def _table(header: list[str], rows: list[list[str]], numeric: bool = True) -> list[str]:
    """A markdown table, first column left-aligned, the others right-aligned when ``numeric``."""
    align = "---:" if numeric else "---"
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + [align] * (len(header) - 1)) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _by_context(results: dict, task: str, value: Callable[[dict], str]) -> list[str]:
    contexts = [k for k in results[task] if k.isdigit()]
    names = list(results["methods"])
    rows = [[f"`{n}`"] + [value(results[task][c][n]) for c in contexts] for n in names]
    return _table(["method"] + [f"C={c}" for c in contexts], rows)


def _summary(results: dict) -> list[str]:
    out = ["## Bits per element (K and V, windows at 16 bits)", ""]
    bpe = results["bits_per_element"]
    cols = [k for k in next(iter(bpe.values()))]
    out += _table(["method"] + [f"C={c}" if c.isdigit() else c for c in cols],
                  [[f"`{n}`"] + [f"{v[c]:.3f}" for c in cols] for n, v in bpe.items()]) + [""]
    if "perplexity" in results:
        ref = _reference(results)
        out += [f"## Perplexity ({results['perplexity']['tokens']} continuation tokens after a prefill of C - "
                f"{results['perplexity']['tokens']})", ""]
        out += _by_context(results, "perplexity", lambda r: f"{r['ppl']:.3f}") + [""]
        if ref is not None:
            out += ["Relative to BF16 (`ppl / ppl_bf16 - 1`, %):", ""]
            out += _relative_ppl(results, ref) + [""]
    if "agreement" in results:
        n = results["agreement"]["tokens"]
        out += [f"## Greedy-token agreement with BF16 over {n} tokens (share of steps; matched prefix in brackets)", ""]
        out += _by_context(results, "agreement", lambda r: f"{r['agreement']:.3f} ({r['prefix']:.3f})") + [""]
    return out


def _reference(results: dict) -> str | None:
    return next((name for name, info in results["methods"].items() if info.get("reference")), None)


def _relative_ppl(results: dict, ref: str) -> list[str]:
    contexts = [k for k in results["perplexity"] if k.isdigit()]
    rows = []
    for n in results["methods"]:
        rows.append([f"`{n}`"] + [
            f"{100 * (results['perplexity'][c][n]['ppl'] / results['perplexity'][c][ref]['ppl'] - 1):+.2f}"
            for c in contexts])
    return _table(["method"] + [f"C={c}" for c in contexts], rows)


def _needle(results: dict) -> list[str]:
    nd = results.get("needle")
    if not nd:
        return []
    if "skipped" in nd:
        return ["## Needle in a haystack", "", f"Skipped: {nd['skipped']}", ""]
    out = [f"## Needle-in-a-haystack accuracy (mode `{nd['mode']}`, {nd['per_cell']} prompts per length and depth, "
           f"depths {', '.join(f'{d:g}' for d in nd['depths'])})", ""]
    lengths = [str(L) for L in nd["lengths"]]
    rows = [[f"`{n}`"] + [f"{acc[L]:.3f}" if L in acc else "-" for L in lengths] for n, acc in nd["by_length"].items()]
    return out + _table(["method"] + [f"L={L}" for L in lengths], rows) + [""]


def _layers(results: dict) -> list[str]:
    lay = results.get("layers")
    if not lay:
        return []
    out = [f"## Per-layer fidelity (teacher-forced decode of {lay['windows']} held-out windows of {lay['context']} "
           f"tokens, last {lay['scored_queries']} queries)", ""]
    per_method = lay["metrics"]
    num_layers = len(next(iter(per_method.values())))
    for metric in METRICS:
        out += [f"### {METRIC_TITLES[metric]}", ""]
        rows = []
        for name, layers in per_method.items():
            values = [layer[metric] for layer in layers]
            rows.append([f"`{name}`"] + [f"{v:.3g}" for v in values] + [f"{sum(values) / len(values):.3g}"])
        out += _table(["method"] + [f"L{i}" for i in range(num_layers)] + ["mean"], rows) + [""]
    return out


def markdown(results: dict) -> str:
    """The human-readable report: settings line, method list, then one table per metric."""
    s = results["settings"]
    lines = ["# KV-cache compression: side-by-side evaluation", "",
             f"Model `{results['model']}` ({results['fingerprint']['architecture']}, "
             f"{results['fingerprint']['num_layers']} layers, head_dim {results['fingerprint']['head_dim']}), "
             f"{results['dtype']} on {results['device']}; "
             f"held-out `{results['data']}`, calibration `{results['calib']}`; {s['num_samples']} windows per context; "
             f"{results['date']}; {results.get('runtime_s', 0):.0f} s.", "", "## Methods", ""]
    lines += _table(["method", "what", "rotations"],
                    [[f"`{n}`", m["description"], m["rotations"]] for n, m in results["methods"].items()],
                    numeric=False) + [""]
    lines += _summary(results) + _needle(results) + _layers(results)
    if results.get("plots"):
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in results["plots"]] + [""]
    return "\n".join(lines)
