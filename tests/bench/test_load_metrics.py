"""The load figures on known data: percentiles, TPOT, and the steady-state window rule on
synthetic timings (no server)."""

from __future__ import annotations

import pytest

from oscar_compile.bench.load_client import RequestRecord
from oscar_compile.bench.load_metrics import distribution, percentile, steady_figures, steady_window, summarize


def _done(start: float, end: float, ttft: float = 0.1, tokens: int = 3, prompt: int = 4) -> RequestRecord:
    events = [start + ttft + i * (end - start - ttft) / max(tokens - 1, 1) for i in range(tokens)]
    return RequestRecord(True, prompt, tokens, outcome="completed", start=start, end=end, event_times=events,
                         num_output_tokens=tokens)


def test_percentiles_and_means_on_known_data():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([5.0], 99) == 5.0 and percentile([], 50) is None
    values = [float(v) for v in range(1, 102)]  # 1..101: percentile q sits at 1 + q
    d = distribution(values, scale=10.0)
    assert d == {"mean": pytest.approx(510.0), "p50": pytest.approx(510.0), "p90": pytest.approx(910.0),
                 "p99": pytest.approx(1000.0)}
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_summary_figures():
    done = RequestRecord(True, 4, 3, outcome="completed", start=0.0, end=1.0, event_times=[0.2, 0.5, 0.9],
                         num_output_tokens=3)
    failed = RequestRecord(False, 4, 3, outcome="error", error="http_400", detail="too long", start=0.0, end=0.1)
    s = summarize([done, failed], wall_s=2.0)
    assert (s["completed"], s["errors"], s["errors_by_kind"]) == (1, 1, {"http_400": 1})
    assert s["error_examples"] == {"http_400": "too long"}
    assert s["output_tokens_per_s"] == 1.5 and s["total_tokens_per_s"] == 3.5 and s["requests_per_s"] == 0.5
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["itl_ms"]["p50"] == pytest.approx(350.0) and s["itl_ms"]["mean"] == pytest.approx(350.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(400.0)  # (1.0 - 0.2) / (3 - 1), the first token left out
    assert s["latency_s"]["p99"] == pytest.approx(1.0)


def test_the_steady_window_leaves_out_warm_up_and_drain():
    # sends at 0, 1, ..., 10 s: the window is [1, 10] (10 % of the 10 s sending span skipped) unless told
    assert steady_window([float(t) for t in range(11)]) == (1.0, 10.0)
    assert steady_window([3.0, 5.0], skip_s=0.5) == (3.5, 5.0)
    assert steady_window([2.0, 2.0, 2.0]) is None and steady_window([]) is None  # all at once: rate inf

    records = [
        _done(0.0, 2.0, ttft=1.5),   # sent in the warm-up: no latency counted; completes in the window
        _done(2.0, 4.0, ttft=0.2),   # counted
        _done(4.0, 6.0, ttft=0.4),   # counted
        _done(6.0, 12.0, ttft=0.6),  # ends in the drain (after the last send at 10 s): not counted
        _done(10.0, 11.0, ttft=0.8),  # the last send: ends in the drain
    ]
    f = steady_figures(records)
    assert f["window_s"] == [1.0, 10.0] and f["counted"] == 2 and f["completed_in_window"] == 3
    assert f["sent_in_window"] == 4  # the two that end in the drain are left out
    assert f["ttft_ms"]["p50"] == pytest.approx(300.0) and f["ttft_ms"]["p99"] == pytest.approx(398.0)
    assert f["requests_per_s"] == pytest.approx(3 / 9) and f["output_tokens_per_s"] == pytest.approx(9 / 9)
    assert f["total_tokens_per_s"] == pytest.approx(21 / 9)
    # the whole level counts everything over its wall time
    whole = summarize(records, wall_s=12.0)
    assert whole["ttft_ms"]["p50"] == pytest.approx(600.0) and whole["requests_per_s"] == pytest.approx(5 / 12)
    assert whole["steady"] == f


def test_a_level_sent_all_at_once_has_no_steady_state():
    f = steady_figures([_done(5.0, 6.0), _done(5.0, 7.0)])
    assert f["counted"] == 0 and f["window_s"] is None and "no steady state" in f["reason"]
