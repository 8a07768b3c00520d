"""Prompt-exact against decode-consistent prefill, paired and incremental, on the bundled model.

The same held-out windows and needle prompts as ``oscar-compile eval --specs oscar-int2
--num-samples 64 --needle-per-cell 30`` (the full measurement: run.sh), taken round-robin: one
window per context and one needle prompt per length under both semantics, then the next, each
result appended to a JSON-lines file as soon as it exists. So a run stopped early (a shared
2-core CPU) leaves paired numbers for every task, on the first n windows / prompts of each.

    PYTHONPATH=. python3 eval/results/2026-12-03-cpu-prefill-semantics/paired.py OUT.jsonl [ROUNDS]
"""

import json
import sys
import time
from pathlib import Path

import torch

from oscar_compile.evaluation.heldout import bos_id, heldout_windows, read_tokens, resolve_paths
from oscar_compile.evaluation.methods import resolve_methods
from oscar_compile.evaluation.needle_task import needle_accuracy, needle_cases, pad_id
from oscar_compile.evaluation.prepare import method_quantizers
from oscar_compile.evaluation.tasks import perplexity
from oscar_compile.formats.prefill import PREFILL_SEMANTICS
from oscar_compile.loading import load_model, resolve_device

CONTEXTS, PPL_TOKENS, WINDOWS = (4096, 1024, 2048), 256, 64
DEPTHS, PER_CELL = (0.0, 0.25, 0.5, 0.75, 1.0), 30
ROT = Path("oscar_compile/bundled/oscar-tiny-qwen3/rotations")


def main(out: str, rounds: int = WINDOWS) -> None:
    model_dir, data, calib = resolve_paths(None, None, None)
    model, tok = load_model(model_dir, resolve_device("cpu"), "auto", tokenizer_required=False)
    bos = bos_id(model, tok)
    (method,) = resolve_methods(["oscar-int2"])
    qz, _ = method_quantizers(model, method, ROT, lambda: read_tokens(calib, tok), bos, None)
    methods = {method.name: qz}
    tokens = read_tokens(data, tok)
    windows = {c: heldout_windows(tokens, c, WINDOWS, bos) for c in CONTEXTS}
    cases = needle_cases(tok, tokens.numpy(), sorted(CONTEXTS), DEPTHS, PER_CELL, 0, bos)
    by_len = {L: [c for c in cases if c.sample.length == L] for L in sorted(CONTEXTS)}
    # round k takes prompt k of each depth in turn: depth k % 5, prompt k // 5 of that cell
    n = len(DEPTHS)
    order = {L: [cs[(k % n) * PER_CELL + k // n] for k in range(len(cs))] for L, cs in by_len.items()}
    with open(out, "a") as f, torch.inference_mode():
        for k in range(rounds):
            for c in CONTEXTS:
                for s in PREFILL_SEMANTICS:
                    t0 = time.time()
                    r = perplexity(model, methods, windows[c][k : k + 1], PPL_TOKENS, 1, semantics=s)[method.name]
                    f.write(
                        json.dumps(
                            dict(task="ppl", context=c, window=k, semantics=s, nll=r["nll"], seconds=time.time() - t0)
                        )
                        + "\n"
                    )
                    f.flush()
                for s in PREFILL_SEMANTICS:
                    case = order[c][k]
                    cell = needle_accuracy(model, methods, [case], "context", 1, pad_id(tok, model), False, s)
                    ok = cell[method.name][0]["correct"]
                    f.write(
                        json.dumps(dict(task="needle", length=c, prompt=k, depth=case.depth, semantics=s, correct=ok))
                        + "\n"
                    )
                    f.flush()


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
