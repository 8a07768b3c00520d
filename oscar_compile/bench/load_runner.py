"""Load levels against one server: closed loop (N clients, each sends when its last request ends)
or open loop (requests sent on an arrival schedule, ``load_arrivals``, whatever the server's pace).

After each level the runner waits for the server to go idle and reads ``/metrics``: preemptions
during the level and KV pages still in use (0 unless pages leaked).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass

from oscar_compile.bench.load_arrivals import arrival_schedule, check_rate
from oscar_compile.bench.load_client import RequestRecord, complete, get
from oscar_compile.bench.load_datasets import Workload
from oscar_compile.bench.load_metrics import summarize
from oscar_compile.bench.load_report import level_label

OPEN_DEFAULT_REQUESTS = 64  # an open level's size without --num-requests or --duration


@dataclass
class Target:
    host: str
    port: int
    api_key: str | None = None


@dataclass(frozen=True)
class Level:
    """A closed level (``concurrency`` clients) or an open one (``request_rate`` requests/s)."""

    concurrency: int | None = None
    request_rate: float | None = None
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("a level has either a concurrency or a request rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None:
            check_rate(self.request_rate, self.burstiness)

    def as_dict(self) -> dict:
        if self.concurrency is not None:
            return {"concurrency": self.concurrency}
        return {"concurrency": None, "request_rate": self.request_rate, "burstiness": self.burstiness}


def progress_line(label: str, records: list[RequestRecord], elapsed_s: float, duration_s: float | None,
                  num_requests: int | None) -> str:
    """One line on a level under way: a level runs for minutes, and silence reads as a hang."""
    done = [r for r in records if r.end]
    bound = " / ".join(b for b in (f"{duration_s:.0f} s" if duration_s is not None else "",
                                    f"{num_requests} requests" if num_requests is not None else "") if b)
    return (f"  {label}: {elapsed_s:.0f} s, {len(records)} requests sent, {len(done)} done "
            f"({sum(r.outcome == 'error' for r in done)} errors), "
            f"{sum(r.num_output_tokens for r in done)} output tokens (sending ends at {bound})")


async def _with_progress(label, records, start, duration_s, num_requests, progress, progress_every_s, work):
    async def report() -> None:
        while True:
            await asyncio.sleep(progress_every_s)
            progress(progress_line(label, records, time.perf_counter() - start, duration_s, num_requests))

    reporter = asyncio.create_task(report()) if progress is not None else None
    try:
        await work
    finally:
        if reporter is not None:
            reporter.cancel()


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

    async def client() -> None:
        while (num_requests is None or len(records) < num_requests) and (
                stop_at is None or time.perf_counter() < stop_at):
            body, record, hang_up = workload.draw(rng, model)
            records.append(record)
            await complete(target.host, target.port, body, record, target.api_key, hang_up, request_timeout_s)

    await _with_progress(f"concurrency {concurrency}", records, start, duration_s, num_requests, progress,
                         progress_every_s, asyncio.gather(*(client() for _ in range(concurrency))))
    return records, time.perf_counter() - start


async def run_open_level(target: Target, model: str, workload: Workload, level: Level, num_requests: int | None,
                         duration_s: float | None, rng: random.Random, arrival_seed: int,
                         request_timeout_s: float = 600.0, progress=None,
                         progress_every_s: float = 10.0) -> tuple[list[RequestRecord], float]:
    """Open-loop load: requests sent at the schedule's offsets, each on its own; the level ends
    when the last one does."""
    offsets = arrival_schedule(level.request_rate, level.burstiness, arrival_seed, num_requests, duration_s)
    records: list[RequestRecord] = []
    start = time.perf_counter()

    async def send() -> None:
        pending = []
        for offset in offsets:
            body, record, hang_up = workload.draw(rng, model)  # before the wait, so that it does not delay the send
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            records.append(record)
            pending.append(asyncio.create_task(
                complete(target.host, target.port, body, record, target.api_key, hang_up, request_timeout_s)))
        await asyncio.gather(*pending)

    await _with_progress(level_label(level.as_dict()), records, start, duration_s, len(offsets), progress,
                         progress_every_s, send())
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


async def served_model(target: Target) -> tuple[str, int | None]:
    """(model id, its max_model_len where the server says it)."""
    status, text = await get(target.host, target.port, "/v1/models", target.api_key)
    if status != 200:
        raise RuntimeError(f"/v1/models answered {status}: {text[:200]}")
    model = json.loads(text)["data"][0]
    return model["id"], model.get("max_model_len")


async def run(target: Target, workload: Workload, levels: list[Level], num_requests: int | None,
              duration_s: float | None, seed: int = 0, warmup: bool = True, on_level=None,
              progress=None, skip_s: float | None = None, served: dict | None = None) -> list[dict]:
    """Every level in turn; one result dict per level (also handed to ``on_level`` as it ends).
    Without either bound, a closed level sends 4 requests per client, an open one
    ``OPEN_DEFAULT_REQUESTS``. ``progress``: see ``run_level``; ``skip_s``: ``load_metrics``;
    ``served`` gets the model id and the max_model_len the server reports."""
    rng = random.Random(seed)
    model, max_model_len = await served_model(target)
    if served is not None:
        served.update(model=model, max_model_len=max_model_len)
    if max_model_len is not None and workload.longest_request() > max_model_len:
        print(f"warning: the server's max_model_len is {max_model_len}, the workload's longest request "
              f"{workload.longest_request()} tokens: longer prompts draw a 400, longer outputs are cut",
              file=sys.stderr)
    if warmup:  # compile kernels / capture graphs on the largest batch, outside the figures
        clients = max((lv.concurrency for lv in levels if lv.concurrency is not None), default=8)
        records, _ = await run_level(target, model, workload.warmup(), clients, clients, None, random.Random(seed + 1))
        failed = [r for r in records if r.outcome == "error"]
        if failed:
            print(f"warning: {len(failed)} of {len(records)} warm-up requests failed, e.g. {failed[0].error}: "
                  f"{failed[0].detail}", file=sys.stderr)
    results = []
    for index, level in enumerate(levels):
        before = await idle_metrics(target)
        if level.concurrency is not None:
            n = num_requests if num_requests is not None or duration_s is not None else 4 * level.concurrency
            records, wall_s = await run_level(target, model, workload, level.concurrency, n, duration_s, rng,
                                              progress=progress)
        else:
            n = num_requests if num_requests is not None or duration_s is not None else OPEN_DEFAULT_REQUESTS
            records, wall_s = await run_open_level(target, model, workload, level, n, duration_s, rng,
                                                   arrival_seed=seed * 1000 + index, progress=progress)
        after = await idle_metrics(target)
        results.append({
            **level.as_dict(),
            "summary": summarize(records, wall_s, skip_s),
            "preemptions": int(after["oscar_preemptions_total"] - before["oscar_preemptions_total"]),
            "aborted_by_server": int(after["oscar_requests_aborted_total"] - before["oscar_requests_aborted_total"]),
            "pages_in_use": {kind: int(after[f'oscar_kv_pages_used{{kind="{kind}"}}']) for kind in ("window", "quant")},
            "still_running": int(after["oscar_requests_running"] + after["oscar_requests_waiting"]),
        })
        if on_level is not None:
            on_level(results[-1])
    return results
