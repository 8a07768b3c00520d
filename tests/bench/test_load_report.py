"""The table puts modes side by side under each level; the plot is optional (matplotlib)."""

from __future__ import annotations

import sys

from oscar_compile.bench.load_client import RequestRecord
from oscar_compile.bench.load_metrics import summarize
from oscar_compile.bench.load_plot import curves, plot
from oscar_compile.bench.load_report import side_by_side, table


def _level(mode: str, rate: float | None, ttft: float) -> dict:
    records = [RequestRecord(True, 4, 2, outcome="completed", start=t, end=t + 1.0, event_times=[t + ttft, t + 0.9],
                             num_output_tokens=2) for t in range(10)]
    kind = {"concurrency": None, "request_rate": rate, "burstiness": 1.0} if rate else {"concurrency": 4}
    return {"mode": mode, **kind, "summary": summarize(records, 11.0), "preemptions": 0,
            "pages_in_use": {"window": 0, "quant": 0}}


def _runs() -> list[dict]:
    return [{"mode": mode, "levels": [_level(mode, 1.0, ttft), _level(mode, 4.0, 2 * ttft), _level(mode, None, ttft)]}
            for mode, ttft in (("int2", 0.1), ("bf16", 0.2))]


def test_modes_side_by_side_in_one_table():
    levels = side_by_side(_runs())
    assert [(lv["mode"], lv.get("request_rate")) for lv in levels] == [
        ("int2", 1.0), ("bf16", 1.0), ("int2", 4.0), ("bf16", 4.0), ("int2", None), ("bf16", None)]
    lines = table(levels).splitlines()
    assert "TTFT p50/p90/p99 ms" in lines[0] and len(lines) == 2 + 6
    assert lines[2].split()[:3] == ["int2", "1", "req/s"] and "conc 4" in lines[-1]
    # sends at 0..9 s of 1 s each: window [0.9, 9]; sent in it: 1..9 s; ended in it too: 1..8 s
    assert "steady (8/9)" in lines[2]


def test_the_plot_is_throughput_against_ttft_p99_over_rates(tmp_path, monkeypatch):
    lines = curves(_runs())
    assert list(lines) == ["int2", "bf16"] and [label for _, _, label in lines["int2"]] == ["1 req/s", "4 req/s"]
    assert lines["bf16"][0][1] > lines["int2"][0][1]  # TTFT p99 (ms) of bf16's slower synthetic first token
    path = tmp_path / "load.png"
    assert plot(_runs(), path) == f"wrote {path}" and path.stat().st_size > 0
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed: said, and skipped
    assert "matplotlib is not installed" in plot(_runs(), tmp_path / "no.png")
    assert not (tmp_path / "no.png").exists()
