"""The command line of ``python -m oscar_compile.bench.serve`` (its module docstring says what each
part measures); apart so that the benchmark module holds the measurements."""

from __future__ import annotations

import argparse

from oscar_compile.bench.e2e import DEFAULT_SYSTEMS, SYSTEMS
from oscar_compile.bench.prefill_swap import ENGINES


def build_parser(description: str, shapes: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m oscar_compile.bench.serve", description=description)
    parser.add_argument("--shapes", nargs="+", default=["8b", "4b"], choices=shapes)
    parser.add_argument("--contexts", nargs="*", type=int, default=[8192, 32768, 131072])
    parser.add_argument("--capacity-contexts", nargs="*", type=int, default=[32768, 100000])
    parser.add_argument("--kv-memory", type=float, default=None,
                        help="KV budget in GiB (default: 85%% of free GPU memory)")
    parser.add_argument("--e2e-batches", nargs="*", type=int, default=[], help="end-to-end runs (e.g. 1 16 64)")
    parser.add_argument("--e2e-prompt", type=int, default=8192, help="prompt tokens of the end-to-end runs")
    # the prefill issue's workload: 8k prompts, 256 new tokens (more would flatter INT2's decode),
    # a KV budget that fits beside an 8B model on an 80 GB card
    parser.add_argument("--e2e-output", type=int, default=256, help="generated tokens of the end-to-end runs")
    parser.add_argument("--e2e-kv-memory", type=float, default=60.0, help="KV budget in GiB of the runtime's e2e runs")
    parser.add_argument("--e2e-time-limit", type=float, default=240.0,
                        help="seconds one system may spend before it skips its remaining batch sizes")
    parser.add_argument("--e2e-systems", nargs="+",
                        choices=SYSTEMS, help="end-to-end systems to run, in this order (default: "
                        f"{' '.join(DEFAULT_SYSTEMS)}; *-sync: overlapped steps off; oscar-int2-prompt-exact: "
                        "prompt-exact prefill; oscar-int2-no-prefix-caching: prefix caching off)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="prefill token budget per step (e2e)")
    parser.add_argument("--compare-unfused", action="store_true",
                        help="also time decode steps of models rewritten without the fused elementwise ops")
    parser.add_argument("--parts", nargs="+", default=["decode", "capacity", "e2e"],
                        choices=("decode", "capacity", "e2e", "ttft", "swap", "structured", "steps"),
                        help="sections to run")
    parser.add_argument("--step-contexts", nargs="+", type=int, default=[8192],
                        help="--parts steps: where the prompt of the prefill and mixed steps ends (their chunk "
                             "is --max-num-batched-tokens)")
    parser.add_argument("--step-decodes", type=int, default=31,
                        help="--parts steps: decode rows beside the mixed step's chunk (31: batch 32 of the e2e runs)")
    parser.add_argument("--structured-batch", type=int, default=32, help="batch of the structured-output row")
    parser.add_argument("--structured-prompt", type=int, default=512, help="prompt tokens of the structured row")
    parser.add_argument("--structured-output", type=int, default=256, help="generated tokens of the structured row")
    parser.add_argument("--ttft-contexts", nargs="+", type=int, default=[32768, 131072],
                        help="prompt lengths of the TTFT rows (--parts ttft)")
    parser.add_argument("--ttft-engines", nargs="+", choices=list(ENGINES), default=list(ENGINES),
                        help="the INT2 engines of the TTFT rows (the BF16 mode's row always runs)")
    parser.add_argument("--ttft-new-tokens", type=int, default=512,
                        help="tokens that differ at the end of the follow-up prompt of the prefix-hit rows")
    parser.add_argument("--swap-context", type=int, default=100000,
                        help="sequence length of the swap row (--parts swap)")
    parser.add_argument("--tensor-parallel-size", nargs="+", type=int, default=[1], metavar="N",
                        help="decode and capacity rows with the model split over N GPUs (e.g. 1 2: side by side)")
    parser.add_argument("--deterministic", action="store_true",
                        help="run every part in deterministic mode (batch-invariant matmuls, fixed attention "
                             "splits; EngineConfig(deterministic=True)), to measure what it costs")
    parser.add_argument("--decode-batches", nargs="+", type=int, default=[1],
                        help="batch sizes of the decode rows (default 1)")
    parser.add_argument("--plan-ab", action="store_true",
                        help="decode rows: eager steps with the attention plan memoized per step against "
                             "planned at every call (issue #32: the host time the plan saves)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    return parser
