"""Prefix-affinity routing against Ray Serve's default router, on a shared-prefix workload:
``python -m oscar_compile.bench.ray_prefix_affinity``.

    python -m oscar_compile.bench.ray_prefix_affinity --out DIR [--replicas 2] [--docs 4] [--per-doc 6]
        [--doc-len 1024] [--concurrency 4] [serve options, e.g. --device cpu --replica-cpus 0.5]

The workload stands for agents and RAG: a few long documents (``--doc-len`` random token ids),
each shared by ``--per-doc`` requests that add a question of their own (``--tail-len`` tokens) and
generate ``--max-tokens``. Requests go in a seeded random order, ``--concurrency`` at a time, as
streams. For each router (``prefix``: ours; ``default``: Ray Serve's power of two choices) a fresh
application of ``--replicas`` replicas serves the same requests on a local Ray cluster (or
``--ray-address``), so every cache starts empty.

Figures: the prefix-cache hit rate (cached prompt tokens over prompt tokens, from each response's
``usage``), the share of requests that resumed past their document, TTFT (send to the first event
with text), and throughput (requests and prompt tokens per second of wall time). Prints a table;
writes ``results.json`` under ``--out``.
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from oscar_compile.bench.load_metrics import percentile


def build_parser():
    from oscar_compile.cli import serve

    parser = serve.build_parser(prog="python -m oscar_compile.bench.ray_prefix_affinity")
    group = parser.add_argument_group("workload")
    group.add_argument("--out", required=True, help="folder for results.json")
    group.add_argument("--docs", type=int, default=4)
    group.add_argument("--per-doc", type=int, default=6)
    group.add_argument("--doc-len", type=int, default=1024)
    group.add_argument("--tail-len", type=int, default=32)
    group.add_argument("--max-tokens", type=int, default=16)
    group.add_argument("--concurrency", type=int, default=4)
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--routers", nargs="+", choices=("prefix", "default"), default=["prefix", "default"])
    return parser


def workload(args) -> list[tuple[int, list[int]]]:
    """(document index, prompt) of every request, in sending order."""
    rng = random.Random(args.seed)
    docs = [[rng.randrange(100, 8000) for _ in range(args.doc_len)] for _ in range(args.docs)]
    requests = [(d, docs[d] + [rng.randrange(100, 8000) for _ in range(args.tail_len)])
                for d in range(args.docs) for _ in range(args.per_doc)]
    rng.shuffle(requests)
    return requests


def _stream(port: int, path: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    ttft, usage, buffer = None, None, b""
    while True:
        chunk = response.read1(65536)
        if not chunk:
            break
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            data = event.decode()[len("data: "):]
            if data == "[DONE]":
                continue
            payload = json.loads(data)
            if ttft is None and payload.get("choices") and payload["choices"][0].get("text"):
                ttft = time.perf_counter() - start
            usage = payload.get("usage") or usage
    conn.close()
    if response.status != 200 or usage is None:
        raise RuntimeError(f"request failed: {response.status}")
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - start, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def _router_counts(port: int, path: str) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    text = conn.getresponse().read().decode()
    conn.close()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith(("oscar_router_prefix_", "oscar_ingress_resent"))}


def run_router(args, router: str, port: int, requests) -> dict:
    from ray import serve

    from oscar_compile.cli import serve as cli
    from oscar_compile.cli.serve_replicas import build_application

    app = build_application(args, cli.engine_config(args), cli.server_config(args), router=router)
    serve.run(app, name=f"bench-{router}", route_prefix=f"/{router}")
    path = f"/{router}/v1/completions"
    try:
        _stream(port, path, [1, 2, 3], 2)  # one short request: every replica's first call out of the timing
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            records = list(pool.map(lambda r: _stream(port, path, r[1], args.max_tokens), requests))
        wall = time.perf_counter() - start
        counts = _router_counts(port, f"/{router}/metrics")
    finally:
        serve.delete(f"bench-{router}")
    prompt = sum(r["prompt_tokens"] for r in records)
    ttfts = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    resumed = sum(r["cached_tokens"] >= args.doc_len - 16 for r in records)
    return {"router": router, "num_requests": len(records), "wall_s": round(wall, 3),
            "prefix_hit_rate": round(sum(r["cached_tokens"] for r in records) / prompt, 4),
            "requests_resumed_past_document": resumed,
            "requests_resumed_share": round(resumed / len(records), 4),
            "ttft_ms": {"p50": round(percentile(ttfts, 50) * 1e3, 1), "p90": round(percentile(ttfts, 90) * 1e3, 1),
                        "mean": round(sum(ttfts) / len(ttfts) * 1e3, 1)},
            "throughput": {"requests_per_s": round(len(records) / wall, 3),
                           "prompt_tokens_per_s": round(prompt / wall, 1)},
            "metrics": counts}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{platform.node()}: {cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.replicas = args.replicas or 2
    import ray
    from ray import serve

    ray.init(address=args.ray_address, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
             **({} if args.ray_address else {"num_cpus": max(2, int(args.replicas * args.replica_cpus + 0.999))}))
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    requests = workload(args)
    try:
        results = [run_router(args, router, args.port, requests) for router in args.routers]
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"{'router':8} {'hit rate':>9} {'resumed':>8} {'TTFT p50':>9} {'TTFT p90':>9} {'req/s':>7} "
          f"{'prompt tok/s':>13}")
    for r in results:
        resumed = f"{r['requests_resumed_past_document']}/{r['num_requests']}"
        print(f"{r['router']:8} {r['prefix_hit_rate']:9.3f} {resumed:>8} {r['ttft_ms']['p50']:7.1f}ms "
              f"{r['ttft_ms']['p90']:7.1f}ms {r['throughput']['requests_per_s']:7.2f} "
              f"{r['throughput']['prompt_tokens_per_s']:13.1f}")
    import ray as ray_module

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"command": "python -m oscar_compile.bench.ray_prefix_affinity " + " ".join(argv or sys.argv[1:]),
              "machine": machine(), "ray": ray_module.__version__,
              "workload": {k: getattr(args, k) for k in ("replicas", "docs", "per_doc", "doc_len", "tail_len",
                                                          "max_tokens", "concurrency", "seed", "snapshot_interval",
                                                          "replica_cpus", "max_num_seqs")},
              "results": results}
    (out / "results.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
