"""Load generator for the OpenAI server, on loopback only: ``python -m oscar_compile.bench.load``.

    python -m oscar_compile.bench.load [--url http://127.0.0.1:8000 | --launch bundled|DIR|random:8b]
        [--modes int2 bf16] [--concurrency 1 16 64] [--request-rate 1 4 16 inf] [--burstiness 1]
        [--num-requests N] [--duration S] [--dataset random|rag] [--prompt-len 64:512]
        [--output-len 32:256] [--stream-share 0.5] [--disconnect-share 0.1] [--out load.json]

The equivalent of ``vllm bench serve`` for this server. Levels run one after the other:

- closed loop (``--concurrency``): that many clients each send a request, wait for it to end,
  and send the next;
- open loop (``--request-rate``, requests/s): requests are sent on a Poisson schedule (gamma
  with ``--burstiness`` other than 1, ``load_arrivals``) whatever the server's pace; ``inf``
  sends them all at once.

A level sends until ``--num-requests`` have been sent or ``--duration`` seconds have passed
(the first bound), then waits for its requests to end. Requests are /v1/completions with random
token-id prompts and ``ignore_eos`` (``load_datasets``: fixed or uniform lengths, or a
long-context RAG mix). A share of them stream; a share of the streams hang up (a TCP reset) after
a random number of events: the fault a server must absorb. Figures (``load_metrics``) are
throughput, TTFT, TPOT, ITL and latency over the level's steady state, the warm-up and the drain
left out; after each level the server's ``/metrics`` give preemptions and KV pages still in use.

``--launch`` starts the server itself on a free loopback port (``bundled``: the bundled model;
a directory: ``--model DIR``; ``random:8b`` / ``random:4b`` / ``random:tiny``: a random-weight
Qwen3 of that shape, ``oscar_compile.bench.serve_random``) with ``--max-model-len`` set to the
workload's longest request, passes ``--server-args`` on, and at the end stops it with SIGTERM and
records its exit code and the KV pages in use at exit. ``--modes int2 bf16`` launches one server
per mode, one after the other (two 8B servers do not fit on one GPU), and puts them side by side
in one table and one JSON, with a plot of throughput against TTFT p99 over the rates.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import os
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from urllib.parse import urlparse

from oscar_compile.bench.load_datasets import DATASETS, Workload, parse_length, server_max_model_len
from oscar_compile.bench.load_metrics import STEADY_RULE
from oscar_compile.bench.load_plot import plot
from oscar_compile.bench.load_report import footer, side_by_side, table
from oscar_compile.bench.load_runner import Level, Target, run
from oscar_compile.bench.load_server import MODES, LaunchedServer, launch_args


def loopback_target(url: str, api_key: str | None) -> Target:
    parsed = urlparse(url)
    host = parsed.hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if parsed.scheme != "http" or not ok:
        raise ValueError(f"the load generator only targets http://127.0.0.1 / localhost / [::1], got {url!r}")
    return Target(host, parsed.port or 80, api_key)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m oscar_compile.bench.load", description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", default="http://127.0.0.1:8000", help="a running server (loopback only)")
    where.add_argument("--launch", help="start the server: bundled, a model directory, or random:8b|4b|tiny; it "
                       "is told --max-model-len = the workload's longest prompt + longest output, rounded up to "
                       "a multiple of 16 (unless --server-args sets it)")
    parser.add_argument("--modes", nargs="+", choices=MODES,
                        help="with --launch: one server per mode, one after the other, side by side in the table")
    parser.add_argument("--server-args", default="", help="more flags for the launched server, one string")
    parser.add_argument("--api-key", default=os.environ.get("OSCAR_API_KEY") or None)
    parser.add_argument("--concurrency", type=int, nargs="+",
                        help="closed-loop levels: clients at once (default 1 16 64 unless --request-rate is given)")
    parser.add_argument("--request-rate", type=float, nargs="+", metavar="R",
                        help="open-loop levels: requests per second, Poisson arrivals (inf: all at once); "
                             "run after the --concurrency levels")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="open loop: gamma arrivals of this shape (1: Poisson; < 1 burstier, > 1 more even)")
    parser.add_argument("--num-requests", type=int,
                        help="requests per level (default: 4 x concurrency; an open level: "
                             "64, or all that --duration sends)")
    parser.add_argument("--duration", type=float, help="seconds of sending per level (the level ends at the first "
                        "bound, once its requests end)")
    parser.add_argument("--dataset", choices=DATASETS, default="random",
                        help="random: prompts of --prompt-len random ids; rag: one of --rag-documents shared "
                             "documents of --rag-document-len ids (a retrieved long context) followed by a "
                             "question of --prompt-len ids")
    parser.add_argument("--prompt-len", type=parse_length, default=(64, 512), metavar="N|MIN:MAX",
                        help="prompt (rag: question) tokens, fixed or uniform (default 64:512)")
    parser.add_argument("--output-len", type=parse_length, default=(32, 256), metavar="N|MIN:MAX",
                        help="output tokens, fixed or uniform (default 32:256)")
    parser.add_argument("--rag-documents", type=int, default=4, help="rag: shared documents (default 4)")
    parser.add_argument("--rag-document-len", type=int, default=8192, help="rag: tokens of each (default 8192)")
    parser.add_argument("--stream-share", type=float, default=0.5)
    parser.add_argument("--disconnect-share", type=float, default=0.1, help="share of streams that hang up")
    parser.add_argument("--max-token-id", type=int, default=1000, help="prompt token ids are drawn below this")
    parser.add_argument("--steady-skip", type=float, metavar="S",
                        help="warm-up left out of the steady state: seconds after a level's first request "
                             "(default: 10%% of its sending span)")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="load.json")
    args = parser.parse_args(argv)
    if args.modes and not args.launch:
        parser.error("--modes needs --launch (the generator starts one server per mode)")
    return args


def levels_of(args: argparse.Namespace) -> list[Level]:
    closed = args.concurrency or ([] if args.request_rate else [1, 16, 64])
    opened = args.request_rate or []
    if args.num_requests is None and any(math.isinf(r) for r in opened) and args.duration is not None:
        raise ValueError("--request-rate inf sends everything at once: bound it with --num-requests")
    return [Level(concurrency=c) for c in closed] + [Level(request_rate=r, burstiness=args.burstiness) for r in opened]


def run_one(args, workload: Workload, levels: list[Level], mode: str | None, out: Path) -> dict:
    """All levels against one server (launched for ``mode`` if ``--launch``)."""
    server, run_ = None, {"mode": mode, "served": {}, "levels": []}
    if args.launch:
        log = out.with_suffix(f".{mode}.server.log" if mode else ".server.log")
        extra = launch_args(args.launch, mode, shlex.split(args.server_args), server_max_model_len(workload))
        server = LaunchedServer(args.launch, extra, args.api_key, log)
        target = Target("127.0.0.1", server.port, args.api_key)
    else:
        target = loopback_target(args.url, args.api_key)

    def on_level(level: dict) -> None:
        run_["levels"].append({"mode": mode, **level})
        print(table(run_["levels"][-1:]), flush=True)
        for kind, detail in level["summary"]["error_examples"].items():
            print(f"  {kind}: {detail}", flush=True)

    try:
        if mode:
            print(f"mode {mode}", flush=True)
        asyncio.run(run(target, workload, levels, args.num_requests, args.duration, args.seed,
                        warmup=not args.no_warmup, on_level=on_level, progress=lambda line: print(line, flush=True),
                        skip_s=args.steady_skip, served=run_["served"]))
    finally:
        if server is not None:
            run_["server_exit"] = server.stop()
    return run_


def healthy(run_: dict) -> bool:
    """No KV pages left in use and nothing still running after a level; a clean server exit."""
    lost = [lv for lv in run_["levels"] if lv["pages_in_use"]["window"] or lv["pages_in_use"]["quant"]
            or lv["still_running"]]
    exit_ = run_.get("server_exit")
    return not lost and (exit_ is None or (exit_["exit_code"] == 0
                                           and exit_["pages_in_use_at_exit"] == {"window": 0, "quant": 0}))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        workload = Workload(args.prompt_len, args.output_len, args.stream_share, args.disconnect_share,
                            args.max_token_id, dataset=args.dataset, rag_documents=args.rag_documents,
                            rag_document_len=args.rag_document_len)
        levels = levels_of(args)
        if not args.launch:
            loopback_target(args.url, args.api_key)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"workload": asdict(workload), "launch": args.launch, "server_args": args.server_args,
              "modes": args.modes, "max_model_len": server_max_model_len(workload) if args.launch else None,
              "num_requests": args.num_requests, "duration_s": args.duration, "seed": args.seed,
              "steady_skip_s": args.steady_skip, "steady_state_rule": STEADY_RULE, "runs": []}
    try:
        for mode in args.modes or [None]:
            result["runs"].append(run_one(args, workload, levels, mode, out))
    finally:
        if any(level.request_rate is not None for level in levels):
            result["plot"] = plot(result["runs"], out.with_suffix(".png"),
                                  f"{args.launch or args.url}: {workload.describe()}")
        out.write_text(json.dumps(result, indent=2))
    print()
    print(table(side_by_side(result["runs"])))
    print(footer())
    for run_ in result["runs"]:
        if "server_exit" in run_:
            print(f"server exit{' (' + run_['mode'] + ')' if run_['mode'] else ''}: {run_['server_exit']}")
    if "plot" in result:
        print(result["plot"])
    print(f"wrote {out}")
    return 0 if all(healthy(run_) for run_ in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
