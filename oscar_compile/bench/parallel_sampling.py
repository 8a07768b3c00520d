"""Parallel sampling: one request of ``n`` choices against ``n`` requests of one, through the engine.

``python -m oscar_compile.bench.parallel_sampling [--device cuda] [--prompt-len 500] [--n 8]
[--max-tokens 32] [--out FILE.json]`` serves the bundled model (or ``--model`` with ``--spec`` and
``--rotations``) and runs the same prompt both ways, choice ``i`` and request ``i`` seeded
``seed + i``, with the prefix cache off (so the ``n`` requests cannot share the prompt through
it). Per way: seconds, seconds until every choice has its first token, tokens run through the
model (the prompt prefilled once against ``n`` times), the most window and history pages in use
at once (the prompt's full pages held once against ``n`` times) and whether the two ways gave the
same tokens. Each engine first serves a short warm-up request, so kernel compilation is not
timed. Prints a table and writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from oscar_compile.evaluation.result_file import save_json
from oscar_compile.loading import BUNDLED_MODEL_DIR
from oscar_compile.runtime import LLM, EngineConfig, SamplingParams
from oscar_compile.spec import specs_dir


def _run(llm: LLM, prompt: list[int], params: list[SamplingParams]) -> dict:
    engine = llm.engine
    llm.generate(prompt[:16], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    before = engine.stats().batched_tokens_total
    peak = {"window": 0, "quant": 0}
    firsts: set = set()
    tokens: dict = {}
    start = time.perf_counter()
    first_token_s = None
    for p in params:
        engine.add_request(prompt, p)
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
            firsts.add((out.request_id, out.index))
        if first_token_s is None and len(firsts) == sum(p.n for p in params):
            first_token_s = time.perf_counter() - start
        stats = engine.stats()
        for kind in peak:
            peak[kind] = max(peak[kind], stats.pools[kind].pages_used)
    seconds = time.perf_counter() - start
    return dict(
        seconds=round(seconds, 3),
        all_first_tokens_s=round(first_token_s, 3),
        batched_tokens=engine.stats().batched_tokens_total - before,
        peak_window_pages=peak["window"],
        peak_quant_pages=peak["quant"],
        tokens=sorted(tokens.values()),
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(BUNDLED_MODEL_DIR))
    parser.add_argument("--spec", default=str(specs_dir() / "oscar-int2.yaml"))
    parser.add_argument("--rotations", default=str(BUNDLED_MODEL_DIR / "rotations" / "oscar-int2.safetensors"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-len", type=int, default=500)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-memory-gb", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    rows = []
    for way in ("one request of n", "n requests"):
        config = EngineConfig(
            kv_memory_gb=args.kv_memory_gb,
            max_num_seqs=max(16, args.n),
            max_num_batched_tokens=max(2048, args.prompt_len),
            enable_prefix_caching=False,
        )
        with LLM(args.model, args.spec, args.rotations, device=args.device, config=config) as llm:
            held = np.fromfile(BUNDLED_MODEL_DIR / "heldout.bin", dtype=np.uint16).astype(int)
            prompt = [t % llm.engine.runner.vocab_size for t in held[: args.prompt_len].tolist()]
            base = dict(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
            params = (
                [SamplingParams(seed=args.seed, n=args.n, **base)]
                if way == "one request of n"
                else [SamplingParams(seed=args.seed + i, **base) for i in range(args.n)]
            )
            rows.append(
                dict(way=way, n=args.n, prompt_len=args.prompt_len, device=args.device, **_run(llm, prompt, params))
            )
    same = rows[0].pop("tokens") == rows[1].pop("tokens")
    for row in rows:
        row["same_tokens"] = same
    keys = [k for k in rows[0] if k not in ("n", "prompt_len", "device")]
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(str(row[k]) for k in keys))
    save_json(rows, args.out)
    return rows


if __name__ == "__main__":
    main()
