"""How much a prefix-cache hit past the sink costs in accuracy: ``python -m oscar_compile.evaluation.prefix_hits``.

A hit reuses a cached prefix whose history is stored quantized, so the continuation (the rest of
the prompt, computed after the hit) reads the prefix back in INT-b where a miss, prefilling the
whole prompt at once, attends to it in full precision. On held-out windows of ``prefix +
continuation`` tokens this scores the continuation three ways, with the ``generate()`` cache of a
model rewritten by ``apply``:
- ``miss``: the whole window in one forward (the continuation attends to the prefix in full
  precision, then everything is quantized), what the server computes for a miss;
- ``hit``: the prefix in one forward, then the continuation in a second one over that cache (it
  reads the prefix's history quantized), what the server computes after a hit;
- ``bf16``: the original model.
It prints the continuation perplexities and the relative change hit vs miss, and writes JSON.

This is the cost of the prompt-exact prefill semantics' history hits (``prefix_hits="history"``),
so the rewritten model runs prompt-exact here. Under decode-consistent prefill, the default, a
hit past the sink resumes at a window snapshot and computes what a miss does (exact; tests/
runtime/test_decode_consistent_prefill.py), so there is nothing to measure.
"""
from __future__ import annotations

import argparse
import copy
import inspect
import math

import torch
import torch.nn.functional as F

from oscar_compile.evaluation.result_file import save_json


def continuation_nll(model, windows: torch.Tensor, prefix: int, split: bool) -> float:
    """Mean NLL of tokens ``[prefix + 1, L)`` predicted from their context; ``split`` runs the
    prefix first and the continuation over its cache."""
    total, count = 0.0, 0
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # transformers 5.2x
    with torch.no_grad():
        for row in windows:
            ids = row.unsqueeze(0)
            if split:
                out = model(input_ids=ids[:, :prefix], use_cache=True)
                cache = getattr(out, "cache", None) or out.past_key_values
                logits = model(input_ids=ids[:, prefix:], use_cache=True, **{key: cache}).logits[0, :-1]
            else:
                logits = model(input_ids=ids, use_cache=False).logits[0, prefix:-1]
            targets = row[prefix + 1:]
            total += F.cross_entropy(logits.float(), targets, reduction="sum").item()
            count += targets.numel()
    return total / count


def run(model_dir: str | None, spec_name: str, prefix: int, continuation: int, num_windows: int) -> dict:
    from oscar_compile.artifact import Rotations
    from oscar_compile.evaluation.heldout import heldout_windows, read_tokens
    from oscar_compile.formats.prefill import PROMPT_EXACT
    from oscar_compile.loading import load_model, resolve_model_dir
    from oscar_compile.passes import apply
    from oscar_compile.passes.apply import set_prefill_semantics
    from oscar_compile.spec import shipped_spec

    path = resolve_model_dir(model_dir)
    model, tokenizer = load_model(path, torch.device("cpu"))
    windows = heldout_windows(read_tokens(path / "heldout.bin", tokenizer), prefix + continuation, num_windows,
                              getattr(tokenizer, "bos_token_id", None))
    spec = shipped_spec(spec_name)
    compressed = copy.deepcopy(model)
    apply(compressed, spec, Rotations.load(path / "rotations" / f"{spec_name}.safetensors", compressed))
    set_prefill_semantics(compressed, PROMPT_EXACT)  # the semantics whose history hits this measures
    nll = dict(bf16=continuation_nll(model, windows, prefix, split=False),
               miss=continuation_nll(compressed, windows, prefix, split=False),
               hit=continuation_nll(compressed, windows, prefix, split=True))
    ppl = {k: math.exp(v) for k, v in nll.items()}
    return dict(model=str(path), spec=spec_name, prefix=prefix, continuation=continuation,
                windows=int(windows.shape[0]), perplexity=ppl, hit_vs_miss=ppl["hit"] / ppl["miss"] - 1,
                miss_vs_bf16=ppl["miss"] / ppl["bf16"] - 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oscar_compile.evaluation.prefix_hits",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    parser.add_argument("--spec", default="oscar-int2", help="shipped spec with a rotation file beside the model")
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--continuation", type=int, default=256)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    result = run(args.model, args.spec, args.prefix, args.continuation, args.windows)
    ppl = result["perplexity"]
    print(f"continuation perplexity ({result['windows']} windows, {args.prefix} + {args.continuation} tokens): "
          f"bf16 {ppl['bf16']:.3f}, miss {ppl['miss']:.3f}, hit {ppl['hit']:.3f}; "
          f"hit vs miss {100 * result['hit_vs_miss']:+.2f} %")
    save_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
