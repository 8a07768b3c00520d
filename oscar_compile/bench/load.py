"""Load generator for the OpenAI server, on loopback only: ``python -m oscar_compile.bench.load``.

    python -m oscar_compile.bench.load [--url http://127.0.0.1:8000 | --launch bundled|DIR|random:8b]
        [--concurrency 1 16 64] [--num-requests N] [--duration S] [--prompt-len 64:512]
        [--output-len 32:256] [--stream-share 0.5] [--disconnect-share 0.1] [--out load.json]

Closed loop: at each concurrency level, that many clients each send a request, wait for it to
end, and send the next, until ``--num-requests`` have been sent or ``--duration`` seconds have
passed (whichever comes first; at least one of them bounds every level). Requests are
/v1/completions with random token-id prompts (ids below ``--max-token-id``, so any vocabulary
serves them) and ``ignore_eos``, so output lengths are what the workload draws. A share of them
stream; a share of the streams hang up (a TCP reset) after a random number of events: the fault
a server must absorb. After each level the generator waits for the server to go idle and reads
``/metrics``: preemptions during the level and KV pages still in use (0 unless pages leaked).

``--launch`` starts the server itself on a free loopback port (``bundled``: the bundled model and
its INT2 rotations; a directory: ``--model DIR``; ``random:8b`` / ``random:4b`` /
``random:tiny``: a random-weight Qwen3 of that shape, ``oscar_compile.bench.serve_random``), passes
``--server-args`` on, and at the end stops it with SIGTERM and records its exit code and the KV
pages in use at exit. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

from oscar_compile.bench.load_client import RequestRecord, complete, get
from oscar_compile.bench.load_report import summarize, table
from oscar_compile.bench.load_server import LaunchedServer


@dataclass
class Workload:
    """Lengths are drawn uniformly from the inclusive ranges; shares are probabilities."""

    prompt_len: tuple[int, int] = (64, 512)
    output_len: tuple[int, int] = (32, 256)
    stream_share: float = 0.5
    disconnect_share: float = 0.1  # of the streamed requests
    max_token_id: int = 1000
    temperature: float = 0.0

    def __post_init__(self) -> None:
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be MIN:MAX with 1 <= MIN <= MAX, got {lo}:{hi}")
        for name in ("stream_share", "disconnect_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    def draw(self, rng: random.Random, model: str) -> tuple[dict, RequestRecord, int | None]:
        """(body, an empty record, events before hanging up or None)."""
        num_prompt = rng.randint(*self.prompt_len)
        max_tokens = rng.randint(*self.output_len)
        stream = rng.random() < self.stream_share
        body = {"model": model, "prompt": [rng.randrange(1, self.max_token_id) for _ in range(num_prompt)],
                "max_tokens": max_tokens, "temperature": self.temperature, "ignore_eos": True}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        hang_up = rng.randint(1, max(max_tokens - 1, 1)) if stream and rng.random() < self.disconnect_share else None
        return body, RequestRecord(stream, num_prompt, max_tokens), hang_up


@dataclass
class Target:
    host: str
    port: int
    api_key: str | None = None


def progress_line(concurrency: int, records: list[RequestRecord], elapsed_s: float, duration_s: float | None,
                  num_requests: int | None) -> str:
    """One line on a level under way: a level runs for minutes, and silence reads as a hang."""
    done = [r for r in records if r.end]
    bound = " / ".join(b for b in (f"{duration_s:.0f} s" if duration_s is not None else "",
                                    f"{num_requests} requests" if num_requests is not None else "") if b)
    return (f"  concurrency {concurrency}: {elapsed_s:.0f} s, {len(records)} requests sent, {len(done)} done "
            f"({sum(r.outcome == 'error' for r in done)} errors), "
            f"{sum(r.num_output_tokens for r in done)} output tokens (level ends at {bound})")


async def run_level(target: Target, model: str, workload: Workload, concurrency: int,
                    num_requests: int | None, duration_s: float | None, rng: random.Random,
                    request_timeout_s: float = 600.0, progress=None,
                    progress_every_s: float = 10.0) -> tuple[list[RequestRecord], float]:
    """Closed-loop load: (records, wall seconds). ``progress(line)`` gets a progress line every
    ``progress_every_s`` seconds while the level runs."""
    if num_requests is None and duration_s is None:
        raise ValueError("bound the level: give num_requests or duration_s")
    records: list[RequestRecord] = []
    start = time.perf_counter()
    stop_at = start + duration_s if duration_s is not None else None

    async def report() -> None:
        while True:
            await asyncio.sleep(progress_every_s)
            progress(progress_line(concurrency, records, time.perf_counter() - start, duration_s, num_requests))

    async def client() -> None:
        while (num_requests is None or len(records) < num_requests) and (
                stop_at is None or time.perf_counter() < stop_at):
            body, record, hang_up = workload.draw(rng, model)
            records.append(record)
            await complete(target.host, target.port, body, record, target.api_key, hang_up, request_timeout_s)

    reporter = asyncio.create_task(report()) if progress is not None else None
    try:
        await asyncio.gather(*(client() for _ in range(concurrency)))
    finally:
        if reporter is not None:
            reporter.cancel()
    return records, time.perf_counter() - start


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name" or 'name{labels}': value}."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def idle_metrics(target: Target, timeout: float = 60.0) -> dict[str, float]:
    """/metrics once nothing runs or waits (aborts of hung-up clients land within a step)."""
    deadline = time.monotonic() + timeout
    while True:
        status, text = await get(target.host, target.port, "/metrics", target.api_key)
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}: {text[:200]}")
        metrics = parse_metrics(text)
        if (metrics["oscar_requests_running"] == 0 and metrics["oscar_requests_waiting"] == 0) or \
                time.monotonic() > deadline:
            return metrics
        await asyncio.sleep(0.1)


async def served_model(target: Target) -> str:
    status, text = await get(target.host, target.port, "/v1/models", target.api_key)
    if status != 200:
        raise RuntimeError(f"/v1/models answered {status}: {text[:200]}")
    return json.loads(text)["data"][0]["id"]


async def run(target: Target, workload: Workload, levels: list[int], num_requests: int | None,
              duration_s: float | None, seed: int = 0, warmup: bool = True, on_level=None,
              progress=None) -> list[dict]:
    """Every level in turn; one result dict per level (also handed to ``on_level`` as it ends).
    Without either bound, a level sends 4 requests per client. ``progress``: see ``run_level``."""
    rng = random.Random(seed)
    model = await served_model(target)
    if warmup:  # compile kernels / capture graphs on the largest batch, outside the figures
        warm = Workload(workload.prompt_len, (workload.output_len[0],) * 2, 0.0, 0.0, workload.max_token_id)
        await run_level(target, model, warm, max(levels), max(levels), None, random.Random(seed + 1))
    results = []
    for concurrency in levels:
        n = num_requests if num_requests is not None or duration_s is not None else 4 * concurrency
        before = await idle_metrics(target)
        records, wall_s = await run_level(target, model, workload, concurrency, n, duration_s, rng,
                                          progress=progress)
        after = await idle_metrics(target)
        results.append({
            "concurrency": concurrency,
            "summary": summarize(records, wall_s),
            "preemptions": int(after["oscar_preemptions_total"] - before["oscar_preemptions_total"]),
            "aborted_by_server": int(after["oscar_requests_aborted_total"] - before["oscar_requests_aborted_total"]),
            "pages_in_use": {kind: int(after[f'oscar_kv_pages_used{{kind="{kind}"}}']) for kind in ("window", "quant")},
            "still_running": int(after["oscar_requests_running"] + after["oscar_requests_waiting"]),
        })
        if on_level is not None:
            on_level(results[-1])
    return results


def _length_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


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
    where.add_argument("--launch", help="start the server: bundled, a model directory, or random:8b|4b|tiny")
    parser.add_argument("--server-args", default="", help="more flags for the launched server, one string")
    parser.add_argument("--api-key", default=os.environ.get("OSCAR_API_KEY") or None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--num-requests", type=int, help="requests per level (default: 4 x concurrency)")
    parser.add_argument("--duration", type=float, help="seconds per level (the level ends at the first bound)")
    parser.add_argument("--prompt-len", type=_length_range, default=(64, 512), metavar="MIN:MAX")
    parser.add_argument("--output-len", type=_length_range, default=(32, 256), metavar="MIN:MAX")
    parser.add_argument("--stream-share", type=float, default=0.5)
    parser.add_argument("--disconnect-share", type=float, default=0.1, help="share of streams that hang up")
    parser.add_argument("--max-token-id", type=int, default=1000, help="prompt token ids are drawn below this")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="load.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        workload = Workload(args.prompt_len, args.output_len, args.stream_share, args.disconnect_share,
                            args.max_token_id)
        target = None if args.launch else loopback_target(args.url, args.api_key)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    server = None
    if args.launch:
        server = LaunchedServer(args.launch, shlex.split(args.server_args), args.api_key, Path(args.out))
        target = Target("127.0.0.1", server.port, args.api_key)
    result = {"workload": asdict(workload), "launch": args.launch, "server_args": args.server_args,
              "num_requests": args.num_requests, "duration_s": args.duration, "seed": args.seed, "levels": []}
    try:
        asyncio.run(run(target, workload, args.concurrency, args.num_requests, args.duration, args.seed,
                        warmup=not args.no_warmup,
                        on_level=lambda level: (result["levels"].append(level),
                                                print(table([level]), flush=True)),
                        progress=lambda line: print(line, flush=True)))
    finally:
        if server is not None:
            result["server_exit"] = server.stop()
        Path(args.out).write_text(json.dumps(result, indent=2))
    print()
    print(table(result["levels"]))
    if server is not None:
        print(f"server exit: {result['server_exit']}")
    print(f"wrote {args.out}")
    lost = [lv for lv in result["levels"] if lv["pages_in_use"]["window"] or lv["pages_in_use"]["quant"]
            or lv["still_running"]]
    exit_ok = server is None or (result["server_exit"]["exit_code"] == 0
                                 and result["server_exit"]["pages_in_use_at_exit"] == {"window": 0, "quant": 0})
    return 0 if not lost and exit_ok else 1


if __name__ == "__main__":
    sys.exit(main())
