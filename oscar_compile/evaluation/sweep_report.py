"""The sweep's files: the mixed spec (``.yaml``), everything (``.json``), the per-layer table
(``.md``) and a PNG of sensitivity by layer with the chosen formats. matplotlib is optional
(the ``eval`` extra): without it the PNG is skipped with a logged message, the rest is written."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from .mixed_precision import spec_yaml
from .plots import MISSING, _pyplot

logger = logging.getLogger(__name__)


def layer_table(results: dict) -> str:
    """Markdown: per layer, the KL to BF16 and the gain of every format, and the chosen one."""
    names = [o["format"] for o in results["layers"][0]["options"]]
    header = ["layer"] + [f"KL {n}" for n in names] + ["chosen", "bits/elt"]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    head_dim = results["fingerprint"]["head_dim"]
    for row in results["layers"]:
        cells = [str(row["layer"])]
        for o in row["options"]:
            cells.append("-" if o["kl"] is None else f"{o['kl']:.4g}")
        chosen = next(o for o in row["options"] if o["format"] == row["chosen"])
        cells += [f"**{row['chosen']}**", f"{chosen['row_bits'] / head_dim:.3g}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(results: dict) -> str:
    b, c, base = results["budget"], results["chosen"], results["base"]
    w = results["windows"]
    ppl = ""
    if "bf16" in results:  # perplexity of the same scored tokens relative to BF16, to read beside the KL
        ref = results["bf16"]["nll"]
        ppl = (f" Perplexity vs BF16 on these tokens: base {100 * math.expm1(base['nll'] - ref):+.2f} %, chosen "
               f"{100 * math.expm1(c['nll'] - ref):+.2f} %.")
    return (f"Sweep of `{base['name']}` on `{results['model']}` at a budget of {b['bits_per_element']:g} bits per "
            f"element (floor {b['floor_bits_per_element']:g}): {w['count']} held-out windows of {w['context']} tokens "
            f"({w['taken_from']}), the last {w['scored_tokens']} scored; {results['measure']}.\n\n"
            f"Base KL {base['kl']:.4g}; chosen spec: {c['bits_per_element']:.4g} bits per element, KL predicted "
            f"{c['predicted_kl']:.4g}, measured {c['kl']:.4g}. \"-\": not measured (its extra bits alone exceed "
            f"the budget).{ppl}")


def write_sweep_outputs(results: dict, out: Path) -> list[str]:
    """Write ``out`` (the spec) and ``.json`` / ``.md`` / ``.png`` beside it; returns the paths."""
    if out.suffix not in (".yaml", ".yml"):
        raise ValueError(f"the sweep writes a spec: give --out a .yaml path, got {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    b, c = results["budget"], results["chosen"]
    header = [f"Mixed-precision spec from `oscar-compile sweep` on top of {results['base']['name']} "
              f"({results['base']['source']}),",
              f"budget {b['bits_per_element']:g} bits per element (asymptotic); "
              f"this spec: {c['bits_per_element']:.4g}.",
              f"Continuation KL to BF16 on {results['windows']['count']} held-out windows of "
              f"{results['windows']['context']} tokens: base {results['base']['kl']:.4g}, this spec {c['kl']:.4g}.",
              "Load it like any spec: apply, eval --specs, serve --spec (calibrate rotations for it as usual)."]
    out.write_text(spec_yaml(results["spec"], header))
    files = [str(out)]
    png = _plot(results, out.with_suffix(".png"))
    if png is not None:
        files.append(png)
    results["plots"] = [Path(f).name for f in files[1:]]
    md = out.with_suffix(".md")
    md.write_text(f"# {out.stem}\n\n{summary(results)}\n\n{layer_table(results)}\n"
                  + "".join(f"\n![{p}]({p})\n" for p in results["plots"]))
    data = {k: v for k, v in results.items() if k != "spec"} | {"spec_yaml": out.name,
                                                               "spec_json": json.loads(results["spec"].to_json())}
    js = out.with_suffix(".json")
    js.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return files + [str(md), str(js)]


def _plot(results: dict, path: Path):
    plt = _pyplot()
    if plt is None:
        logger.warning(MISSING.replace("results.md and results.json", "the spec, .md and .json"))
        return None
    layers = results["layers"]
    names = [(k, o["format"]) for k, o in enumerate(layers[0]["options"]) if k and
             any(row["options"][k]["gain"] is not None for row in layers)]  # formats never measured: no bars
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(layers) + 3), 4))
    width = 0.8 / max(1, len(names))
    x = range(len(layers))
    for i, row in enumerate(layers):
        if row["chosen"] != row["options"][0]["format"]:
            ax.axvspan(i - 0.45, i + 0.45, color="gold", alpha=0.3, lw=0, zorder=0)
    for n, (k, name) in enumerate(names):
        gains = [row["options"][k]["gain"] for row in layers]
        ax.bar([i + (n - (len(names) - 1) / 2) * width for i in x], [g if g is not None else 0 for g in gains],
               width, label=f"gain at {name}", zorder=2)
    ax.set_xticks(list(x), [f"L{row['layer']}\n{row['chosen']}" for row in layers], fontsize=8)
    ax.set(xlabel="layer (chosen format; shaded: raised above the base)", ylabel="KL reduction vs base, nats/token",
           title=f"{results['base']['name']} at {results['budget']['bits_per_element']:g} bits/elt: "
                 f"KL {results['base']['kl']:.3g} -> {results['chosen']['kl']:.3g}")
    ax.axhline(0, color="black", lw=0.5)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return str(path)
