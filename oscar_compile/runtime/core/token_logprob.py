"""One token's log-probability and its best alternatives: what the worker scores and the
engine hands out (a sequence keeps its output and prompt entries)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # 1 = the most likely token; set for prompt logprobs
