"""Summarize paired.py's JSON lines, or run.sh's ``oscar-compile eval`` folders: perplexity per
semantics with standard errors, the paired relative cost of decode-consistent prefill, and the
needle accuracy per length.

    python3 eval/results/2026-12-03-cpu-prefill-semantics/summarize.py results.jsonl > summary.md
    python3 eval/results/2026-12-03-cpu-prefill-semantics/summarize.py OUT_DIR_OF_RUN_SH > summary.md
"""

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

PE, DC = "prompt-exact", "decode-consistent"


def _se(xs):
    n = len(xs)
    m = sum(xs) / n
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n) if n > 1 else float("nan")


def _rows_of_runs(folder: Path) -> list[dict]:
    """run.sh's result folders as paired.py's rows (the needle per cell: one row per prompt)."""
    rows = []
    for path in sorted(folder.glob("*/results.json")):
        res = json.loads(path.read_text())
        s = res["settings"]["prefill_semantics"]
        for c, by_method in res.get("perplexity", {}).items():
            if c.isdigit():
                nll = by_method["oscar-int2"]["window_nll"]
                rows += [dict(task="ppl", context=int(c), window=k, semantics=s, nll=x) for k, x in enumerate(nll)]
        for cell in res.get("needle", {}).get("cells", {}).get("oscar-int2", []):
            for k in range(cell["total"]):  # the cell's prompts in order: only the count of correct ones is kept
                rows.append(
                    dict(
                        task="needle",
                        length=cell["length"],
                        prompt=f"{cell['depth']}/{k}",
                        semantics=s,
                        correct=int(k < cell["correct"]),
                    )
                )
    return rows


def main(path: str) -> None:
    source = Path(path)
    rows = _rows_of_runs(source) if source.is_dir() else [json.loads(line) for line in open(source)]
    ppl = defaultdict(dict)  # (context, window) -> {semantics: nll}
    needle = defaultdict(dict)  # (length, prompt) -> {semantics: correct}
    for r in rows:
        if r["task"] == "ppl":
            ppl[(r["context"], r["window"])][r["semantics"]] = r["nll"]
        else:
            needle[(r["length"], r["prompt"])][r["semantics"]] = r["correct"]
    print(
        "| context | windows | ppl prompt-exact (SE) | ppl decode-consistent (SE) "
        "| decode-consistent cost, paired (SE) |"
    )
    print("|---|---:|---:|---:|---:|")
    for c in sorted({k[0] for k in ppl}):
        pairs = [v for k, v in sorted(ppl.items()) if k[0] == c and len(v) == 2]
        pe, dc = [p[PE] for p in pairs], [p[DC] for p in pairs]
        diff = [b - a for a, b in zip(pe, dc, strict=True)]
        n = len(pairs)
        m_pe, m_dc, m_d = sum(pe) / n, sum(dc) / n, sum(diff) / n

        def ppl_se(m, xs):
            return f"{math.exp(m):.4f} ({math.exp(m) * _se(xs):.4f})"

        print(
            f"| {c} | {n} | {ppl_se(m_pe, pe)} | {ppl_se(m_dc, dc)} | "
            f"{100 * math.expm1(m_d):+.3f} % ({100 * _se(diff):.3f} %) |"
        )
    print()
    # (from run.sh's folders the per-prompt pairing is not kept: "differ" is then |correct_a - correct_b| per cell)
    print("| length | prompts | needle prompt-exact | needle decode-consistent | prompts that differ |")
    print("|---|---:|---:|---:|---:|")
    for L in sorted({k[0] for k in needle}):
        pairs = [v for k, v in sorted(needle.items()) if k[0] == L and len(v) == 2]
        n = len(pairs)
        a, b = sum(p[PE] for p in pairs) / n, sum(p[DC] for p in pairs) / n
        print(f"| {L} | {n} | {a:.3f} | {b:.3f} | {sum(p[PE] != p[DC] for p in pairs)} |")


if __name__ == "__main__":
    main(sys.argv[1])
