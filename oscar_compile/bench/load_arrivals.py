"""When an open-loop level sends its requests: Poisson arrivals, or gamma arrivals of a chosen burstiness.

Open loop is what a public endpoint sees: users arrive at their own pace whether or not the
server keeps up, so a slow server grows a queue instead of slowing its clients down (the closed
loop hides that). The gaps between arrivals are gamma-distributed with shape ``burstiness`` and
mean ``1 / rate``, as ``vllm bench serve`` draws them: shape 1 is the exponential gap of a
Poisson process, below 1 the arrivals come in bursts, above 1 more evenly. ``rate = inf`` sends
every request at once. The schedule comes from its own generator, so a seed fixes it whatever
the prompts drawn beside it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator


def check_rate(rate: float, burstiness: float = 1.0) -> None:
    if not rate > 0:  # also refuses nan
        raise ValueError(f"a request rate must be > 0 requests/s (or inf), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")


def arrival_offsets(rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Seconds from the level's start at which each request is sent, without end (the caller
    stops at its bound)."""
    check_rate(rate, burstiness)
    offset = 0.0
    while True:
        yield offset
        if math.isfinite(rate):
            offset += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def arrival_schedule(rate: float, burstiness: float, seed: int, num_requests: int | None = None,
                     duration_s: float | None = None) -> list[float]:
    """The first offsets up to ``num_requests`` requests or ``duration_s`` seconds (the first bound)."""
    if num_requests is None and (duration_s is None or not math.isfinite(rate)):
        raise ValueError("bound the schedule: give num_requests (or duration_s with a finite rate)")
    offsets: list[float] = []
    draws = arrival_offsets(rate, burstiness, random.Random(seed))
    while num_requests is None or len(offsets) < num_requests:
        offset = next(draws)
        if duration_s is not None and offset >= duration_s:
            break
        offsets.append(offset)
    return offsets
