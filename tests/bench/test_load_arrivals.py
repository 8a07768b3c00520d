"""The open loop's arrival schedule: its mean rate, its burstiness, its bounds, and a seed that fixes it."""

from __future__ import annotations

import math
import statistics

import pytest

from oscar_compile.bench.load_arrivals import arrival_schedule


def _gaps(offsets: list[float]) -> list[float]:
    return [b - a for a, b in zip(offsets, offsets[1:], strict=False)]


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
def test_poisson_arrivals_have_the_asked_rate_and_exponential_gaps(rate):
    offsets = arrival_schedule(rate, 1.0, seed=3, num_requests=4001)
    gaps = _gaps(offsets)
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    # 4000 exponential gaps: the mean's relative standard error is 1/sqrt(4000) = 1.6 %
    assert len(gaps) / offsets[-1] == pytest.approx(rate, rel=0.05)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.08)  # exponential: CV 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_keeps_the_rate_and_sets_the_spread(burstiness):
    gaps = _gaps(arrival_schedule(2.0, burstiness, seed=1, num_requests=4001))
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.08)
    # gamma of shape k: coefficient of variation 1 / sqrt(k)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_a_seed_fixes_the_schedule():
    a = arrival_schedule(3.0, 1.0, seed=7, num_requests=50)
    assert a == arrival_schedule(3.0, 1.0, seed=7, num_requests=50)
    assert a != arrival_schedule(3.0, 1.0, seed=8, num_requests=50)


def test_bounds_and_rate_inf():
    assert arrival_schedule(math.inf, 1.0, seed=0, num_requests=5) == [0.0] * 5
    timed = arrival_schedule(10.0, 1.0, seed=0, duration_s=20.0)
    assert all(t < 20.0 for t in timed) and len(timed) == pytest.approx(200, rel=0.15)
    assert len(arrival_schedule(10.0, 1.0, seed=0, num_requests=7, duration_s=1000.0)) == 7  # the first bound
    with pytest.raises(ValueError, match="bound the schedule"):
        arrival_schedule(math.inf, 1.0, seed=0, duration_s=5.0)
    for rate, burstiness in ((0.0, 1.0), (-1.0, 1.0), (math.nan, 1.0), (1.0, 0.0), (1.0, math.inf)):
        with pytest.raises(ValueError):
            arrival_schedule(rate, burstiness, seed=0, num_requests=3)
