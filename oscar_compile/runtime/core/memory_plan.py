"""The KV budget from a profile run: what ``--gpu-memory-utilization`` leaves for the pages.

Why. A budget given in GiB (``--kv-memory``) says nothing of what else the GPU must hold: the
weights, the activations of an 8k-token step, its prompt-logprob logits (8192 x vocab in fp32,
about 5 GB at Qwen3's vocabulary), the sampler's and the grammar mask's buffers, the extend
scratch, the CUDA-graph pools and the pools allocated beside the KV pages (staging, scratch
pages). A budget that looked safe then ran out of memory at batch 32. As vLLM v1 does
(``gpu_worker.determine_available_memory``), the worker runs the largest step the config
allows on a runner with one sequence's pages, and the KV pages get what is left of the share
of the GPU the engine may fill:

    kv = utilization x total - (peak in use - the profile runner's pages + pools allocated later)

``peak in use`` is everything on the device at the step's peak: the weights, the CUDA context,
the graph pools, the step's transient tensors, and what other processes hold (counted against
the share: a conservative reading; vLLM counts only its own process). Under tensor parallelism
every rank profiles and the smallest remainder wins (every rank allocates the page counts rank 0
plans). Too small a remainder stops the start with the numbers (:class:`InsufficientMemoryError`).

Plain arithmetic over measured bytes (no torch): the measuring is
``runtime/worker/memory_profile.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from oscar_compile.runtime.core.page_plan import GIB


class InsufficientMemoryError(ValueError):
    """The share of GPU memory asked for cannot hold the engine (the serve command prints it and
    exits with status 2, as for any bad setting)."""


@dataclass(frozen=True)
class MemoryProfile:
    """What one device's profile run measured, in bytes.

    - ``total``: the device's memory;
    - ``peak_in_use``: in use at the largest step's peak, the profile runner alive (its pages,
      graph pools and step buffers included), other processes' memory included;
    - ``profile_pools``: the profile runner's own page pools, inside ``peak_in_use``: the real
      pools (the budget and the ``later_pools``) take their place.
    """

    total: int
    peak_in_use: int
    profile_pools: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.profile_pools <= self.peak_in_use:
            raise ValueError(f"profile pools of {self.profile_pools} B outside the {self.peak_in_use} B in use")
        if self.total <= 0:
            raise ValueError(f"device memory must be > 0 bytes, got {self.total}")


@dataclass(frozen=True)
class MemoryPlan:
    """One device's share and what it leaves for the KV pages (bytes; ``kv_bytes`` may be < 0)."""

    total: int
    utilization: float
    requested: int  # utilization x total
    in_use: int  # peak in use without the profile runner's pages
    later_pools: Mapping[str, int] = field(default_factory=dict)  # allocated beside the KV pages
    rank: int = 0

    @property
    def non_kv(self) -> int:
        return self.in_use + sum(self.later_pools.values())

    @property
    def kv_bytes(self) -> int:
        return self.requested - self.non_kv

    def utilization_for(self, kv_bytes: int) -> float:
        """The share of the device that would leave ``kv_bytes`` for the pages."""
        return (self.non_kv + kv_bytes) / self.total


def plan_memory(profile: MemoryProfile, utilization: float, later_pools: Mapping[str, int] | None = None,
                rank: int = 0) -> MemoryPlan:
    """The plan of one device: its share (``utilization`` of its memory), less what the profile
    run measured in use and the pools sized from the plan but allocated after it."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    later = dict(later_pools or {})
    if any(v < 0 for v in later.values()):
        raise ValueError(f"pool sizes must be >= 0 bytes, got {later}")
    return MemoryPlan(total=profile.total, utilization=utilization, requested=int(utilization * profile.total),
                      in_use=profile.peak_in_use - profile.profile_pools, later_pools=later, rank=rank)


def smallest(plans: Sequence[MemoryPlan]) -> MemoryPlan:
    """The plan with the least left for the pages (tensor parallelism: every rank allocates the
    page counts planned once, so the tightest rank decides)."""
    if not plans:
        raise ValueError("no memory plan to choose from")
    return min(plans, key=lambda p: (p.kv_bytes, p.rank))


def checked_kv_bytes(plan: MemoryPlan, min_kv_bytes: int, needs: str, num_ranks: int = 1) -> int:
    """``plan.kv_bytes``, or :class:`InsufficientMemoryError` when it is under ``min_kv_bytes``
    (``needs`` says what that minimum holds, e.g. "one sequence of max_model_len 40960").
    The message names what was asked for, what the rest takes, what is left, and what fits."""
    kv = plan.kv_bytes
    if kv >= min_kv_bytes:
        return kv
    where = f" on rank {plan.rank} of {num_ranks}" if num_ranks > 1 else ""
    pools = "".join(f", {name} {_size(b)}" for name, b in plan.later_pools.items() if b)
    left = _size(kv) if kv > 0 else "nothing"
    need_share = plan.utilization_for(min_kv_bytes)
    if need_share <= 1:
        fits = f"--gpu-memory-utilization {math.ceil(need_share * 100 - 1e-9) / 100:.2f} would fit it"
    else:
        fits = (f"even the whole device ({_size(plan.total)}) would not fit it: lower --max-num-batched-tokens, "
                "--max-num-seqs or --max-model-len")
    raise InsufficientMemoryError(
        f"GPU memory{where}: --gpu-memory-utilization {plan.utilization:g} asks for {_size(plan.requested)} of "
        f"{_size(plan.total)}; the weights and the largest step take {_size(plan.in_use)} (in use at the profile "
        f"run's peak{pools}), which leaves {left} for the KV cache, and {needs} needs {_size(min_kv_bytes)}: "
        f"{fits} (or give --kv-memory GiB to size the cache yourself)")


def _size(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB // 10 else f"{num_bytes / 2**20:.1f} MiB"


@dataclass(frozen=True)
class StepRow:
    """One row of the profile step: ``num_new`` tokens after ``cache_len`` cached ones."""

    cache_len: int
    num_new: int


def largest_step(max_num_seqs: int, max_num_batched_tokens: int, context_len: int) -> list[StepRow]:
    """The rows of the largest step a config allows, each ending at ``context_len`` tokens (the
    longest context one sequence reaches: attention and the prefill's history reads grow with it).

    ``max_num_batched_tokens`` tokens over ``min(max_num_seqs, tokens)`` rows, each row at least
    one token and at most ``context_len``: the first rows take the chunks, the rest decode. Fewer
    tokens only when the rows cannot hold them (``max_num_seqs x context_len`` is less)."""
    if min(max_num_seqs, max_num_batched_tokens, context_len) < 1:
        raise ValueError(f"a step needs >= 1 sequence, token and context position, got {max_num_seqs}, "
                         f"{max_num_batched_tokens}, {context_len}")
    num_rows = min(max_num_seqs, max_num_batched_tokens)
    lens = [1] * num_rows
    left = max_num_batched_tokens - num_rows
    for i in range(num_rows):
        more = min(context_len - 1, left)
        lens[i] += more
        left -= more
    return [StepRow(context_len - n, n) for n in lens]
