"""Request latencies observed in one engine step: the raw values of the server's histograms.

The engine stamps each sequence with ``time.monotonic()`` (never the wall clock, which may jump)
where the truth is: its arrival (the server hands it over when the HTTP request came in, before
tokenizing; offline, ``add_request``), the step that first schedules it, the step that reads each
of its tokens on the host, and its finish. A step collects the differences here, in seconds; the
async engine hands them to its observers (the server's Prometheus histograms, server/metrics.py).
Plain Python: the engine does not depend on a metrics library.

- queue time: arrival -> first scheduled (once per request; a preempted request's later waits
  are not counted again);
- time to first token: arrival -> the host reads its first output token, once per request (a
  request is one prompt: its ``n`` choices fork from the first, whose first token is the
  request's; a request that generates nothing, ``max_tokens`` 0, has none);
- inter-token latency: between two consecutive output tokens of one choice, as the host reads
  them (one step apart, plus any preemption in between);
- end-to-end: arrival -> finish, for requests that stop or reach their length; aborted requests
  (the client gone, a timeout) are not counted, as vLLM counts only finished ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from oscar_compile.runtime.core.sequence import Sequence


@dataclass
class StepLatencies:
    """Seconds observed in one step, one entry per event."""

    queue: list[float] = field(default_factory=list)
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.queue or self.time_to_first_token or self.inter_token or self.e2e)

    def scheduled(self, seq: Sequence, now: float) -> None:
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
            self.queue.append(now - seq.arrival_time)

    def token(self, seq: Sequence, now: float) -> None:
        if seq.last_token_time is None:
            if seq.choice_index == 0:  # one per request, as requests_finished_total counts them
                self.time_to_first_token.append(now - seq.arrival_time)
        else:
            self.inter_token.append(now - seq.last_token_time)
        seq.last_token_time = now

    def finished(self, seq: Sequence, now: float) -> None:
        self.e2e.append(now - seq.arrival_time)
