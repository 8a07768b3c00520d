"""Summarize paired.py's JSON lines: perplexity per semantics with standard errors, the paired
relative cost of decode-consistent prefill, and the needle accuracy per length.

    python3 eval/results/2026-12-03-cpu-prefill-semantics/summarize.py results.jsonl > summary.md
"""
import json
import math
import sys
from collections import defaultdict

PE, DC = "prompt-exact", "decode-consistent"


def _se(xs):
    n = len(xs)
    m = sum(xs) / n
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n) if n > 1 else float("nan")


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    ppl = defaultdict(dict)  # (context, window) -> {semantics: nll}
    needle = defaultdict(dict)  # (length, prompt) -> {semantics: correct}
    for r in rows:
        if r["task"] == "ppl":
            ppl[(r["context"], r["window"])][r["semantics"]] = r["nll"]
        else:
            needle[(r["length"], r["prompt"])][r["semantics"]] = r["correct"]
    print("| context | windows | ppl prompt-exact (SE) | ppl decode-consistent (SE) "
          "| decode-consistent cost, paired (SE) |")
    print("|---|---:|---:|---:|---:|")
    for c in sorted({k[0] for k in ppl}):
        pairs = [v for k, v in sorted(ppl.items()) if k[0] == c and len(v) == 2]
        pe, dc = [p[PE] for p in pairs], [p[DC] for p in pairs]
        diff = [b - a for a, b in zip(pe, dc, strict=True)]
        n = len(pairs)
        m_pe, m_dc, m_d = sum(pe) / n, sum(dc) / n, sum(diff) / n

        def ppl_se(m, xs):
            return f"{math.exp(m):.4f} ({math.exp(m) * _se(xs):.4f})"

        print(f"| {c} | {n} | {ppl_se(m_pe, pe)} | {ppl_se(m_dc, dc)} | "
              f"{100 * math.expm1(m_d):+.3f} % ({100 * _se(diff):.3f} %) |")
    print()
    print("| length | prompts | needle prompt-exact | needle decode-consistent | prompts that differ |")
    print("|---|---:|---:|---:|---:|")
    for L in sorted({k[0] for k in needle}):
        pairs = [v for k, v in sorted(needle.items()) if k[0] == L and len(v) == 2]
        n = len(pairs)
        a, b = sum(p[PE] for p in pairs) / n, sum(p[DC] for p in pairs) / n
        print(f"| {L} | {n} | {a:.3f} | {b:.3f} | {sum(p[PE] != p[DC] for p in pairs)} |")


if __name__ == "__main__":
    main(sys.argv[1])
