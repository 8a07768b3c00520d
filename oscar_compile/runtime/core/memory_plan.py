"""The KV budget from a profile run: what ``--gpu-memory-utilization`` leaves for the pages.

Why. A budget given in GiB (``--kv-memory``) says nothing of what else the GPU must hold: the
weights, the activations of an 8k-token step, its prompt-logprob logits (8192 x vocab in fp32,
about 5 GB at Qwen3's vocabulary), the sampler's and the grammar mask's buffers, the extend
scratch, the CUDA-graph pools and the pools allocated beside the KV pages (staging, scratch
pages). A budget that looked safe then ran out of memory at batch 32. As vLLM v1 does
(``gpu_worker.determine_available_memory``), the worker runs the largest step the config
allows on a runner with one sequence's pages, and the KV pages get what is left of the engine's
share of the device:

    own = weights + (peak in use - in use before the profile run) - the profile runner's pages
    kv  = utilization x total - own - the pools allocated later beside the pages

The share is this engine's, as in vLLM: memory held outside it (other processes, other engines
of this process, the CUDA context: what was in use before the profile run less the weights) does
not count against it, but must leave the share free, or the start stops (vLLM's check of the free
memory at start). Under tensor parallelism every rank profiles and the smallest remainder wins
(every rank allocates the page counts rank 0 plans). Too small a remainder stops the start with
the numbers (:class:`InsufficientMemoryError`).

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
    - ``before``: in use before the profile run (the weights loaded, nothing of the runner yet),
      other processes' memory included;
    - ``peak_in_use``: in use at the largest step's peak, the profile runner alive (its pages,
      graph pools and step buffers included);
    - ``profile_pools``: the profile runner's own page pools, inside ``peak_in_use``: the real
      pools (the budget and the later pools) take their place;
    - ``weights``: the model's parameters and buffers on the device, inside ``before``.
    """

    total: int
    before: int
    peak_in_use: int
    profile_pools: int = 0
    weights: int = 0

    def __post_init__(self) -> None:
        if self.total <= 0:
            raise ValueError(f"device memory must be > 0 bytes, got {self.total}")
        if not 0 <= self.before <= self.peak_in_use:
            raise ValueError(f"in use before the profile run ({self.before} B) must be in [0, the peak "
                             f"{self.peak_in_use} B]")
        if not 0 <= self.profile_pools <= self.peak_in_use - self.before:
            raise ValueError(f"profile pools of {self.profile_pools} B outside the profile run's "
                             f"{self.peak_in_use - self.before} B")
        if not 0 <= self.weights <= self.before:
            raise ValueError(f"weights of {self.weights} B outside the {self.before} B in use before the profile run")


@dataclass(frozen=True)
class MemoryPlan:
    """One device's share and what it leaves for the KV pages (bytes; ``kv_bytes`` may be < 0)."""

    total: int
    utilization: float
    requested: int  # utilization x total
    others: int  # held outside the engine: other processes and engines, the CUDA context
    own: int  # the engine's but the pages': weights, the largest step's peak, graph pools, buffers
    later_pools: Mapping[str, int] = field(default_factory=dict)  # allocated beside the KV pages
    rank: int = 0

    @property
    def non_kv(self) -> int:
        return self.own + sum(self.later_pools.values())

    @property
    def kv_bytes(self) -> int:
        return self.requested - self.non_kv

    @property
    def free_for_engine(self) -> int:
        return self.total - self.others

    def utilization_for(self, kv_bytes: int) -> float:
        """The share of the device that would leave ``kv_bytes`` for the pages."""
        return (self.non_kv + kv_bytes) / self.total


def plan_memory(profile: MemoryProfile, utilization: float, later_pools: Mapping[str, int] | None = None,
                rank: int = 0) -> MemoryPlan:
    """The plan of one device: the engine's share (``utilization`` of the device), less what the
    profile run measured of its own and the pools sized from the plan but allocated after it."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    later = dict(later_pools or {})
    if any(v < 0 for v in later.values()):
        raise ValueError(f"pool sizes must be >= 0 bytes, got {later}")
    own = profile.weights + profile.peak_in_use - profile.before - profile.profile_pools
    return MemoryPlan(total=profile.total, utilization=utilization, requested=int(utilization * profile.total),
                      others=profile.before - profile.weights, own=own, later_pools=later, rank=rank)


def smallest(plans: Sequence[MemoryPlan]) -> MemoryPlan:
    """The plan with the least left for the pages (tensor parallelism: every rank allocates the
    page counts planned once, so the tightest rank decides)."""
    if not plans:
        raise ValueError("no memory plan to choose from")
    return min(plans, key=lambda p: (p.kv_bytes, p.rank))


def checked_kv_bytes(plans: Sequence[MemoryPlan], min_kv_bytes: int, needs: str) -> int:
    """The smallest ``kv_bytes`` of ``plans`` (one per device), or :class:`InsufficientMemoryError`
    when a device's share is not free or the smallest is under ``min_kv_bytes`` (``needs`` says
    what that minimum holds, e.g. "one sequence of max_model_len 40960"). The message names what
    was asked for, what the rest takes, what is left, and what fits."""
    for plan in plans:
        if plan.requested > plan.free_for_engine:
            fits = math.floor(plan.free_for_engine / plan.total * 100) / 100
            raise InsufficientMemoryError(
                f"GPU memory{_where(plan, len(plans))}: --gpu-memory-utilization {plan.utilization:g} asks for "
                f"{_size(plan.requested)} of {_size(plan.total)}, but {_size(plan.others)} is held outside this "
                f"engine (other processes or engines, the CUDA context), which leaves {_size(plan.free_for_engine)}: "
                f"--gpu-memory-utilization {fits:.2f} would fit (or free the device)")
    plan = smallest(plans)
    kv = plan.kv_bytes
    if kv >= min_kv_bytes:
        return kv
    pools = "".join(f", {name} {_size(b)}" for name, b in plan.later_pools.items() if b)
    left = _size(kv) if kv > 0 else "nothing"
    need_share = plan.utilization_for(min_kv_bytes)
    if need_share * plan.total <= plan.free_for_engine:
        fits = f"--gpu-memory-utilization {math.ceil(need_share * 100 - 1e-9) / 100:.2f} would fit it"
    else:
        fits = (f"even all of the {_size(plan.free_for_engine)} free for it would not fit it: lower "
                "--max-num-batched-tokens, --max-num-seqs or --max-model-len")
    raise InsufficientMemoryError(
        f"GPU memory{_where(plan, len(plans))}: --gpu-memory-utilization {plan.utilization:g} asks for "
        f"{_size(plan.requested)} of {_size(plan.total)}; the weights and the largest step take {_size(plan.own)} "
        f"(at the profile run's peak{pools}), which leaves {left} for the KV cache, and {needs} needs "
        f"{_size(min_kv_bytes)}: {fits} (or give --kv-memory GiB to size the cache yourself)")


def check_override(plans: Sequence[MemoryPlan], kv_bytes: int) -> None:
    """``--kv-memory`` (an absolute budget): :class:`InsufficientMemoryError` when a device cannot
    hold ``kv_bytes`` of pages beside what its profile run measured and the pools beside the
    pages, in the memory free for the engine (the device less what is held outside it). The
    message names the sizes and the largest ``--kv-memory`` that fits."""
    if kv_bytes < 0:
        raise ValueError(f"kv_bytes must be >= 0, got {kv_bytes}")
    for plan in plans:
        fits = plan.free_for_engine - plan.non_kv
        if kv_bytes <= fits:
            continue
        pools = "".join(f", {name} {_size(b)}" for name, b in plan.later_pools.items() if b)
        if fits > 0:
            advice = f"--kv-memory {math.floor(fits / GIB * 100) / 100:.2f} would fit"
        else:
            advice = "no KV budget fits: lower --max-num-batched-tokens, --max-num-seqs or --max-model-len"
        raise InsufficientMemoryError(
            f"GPU memory{_where(plan, len(plans))}: --kv-memory {_size(kv_bytes)} beside the weights and the largest "
            f"step ({_size(plan.own)} at the profile run's peak{pools}) needs {_size(plan.non_kv + kv_bytes)}, but "
            f"{_size(plan.free_for_engine)} of the device's {_size(plan.total)} is free for this engine: {advice} "
            "(or leave --kv-memory out: --gpu-memory-utilization sizes the cache from the profile run)")


def _where(plan: MemoryPlan, num_ranks: int) -> str:
    return f" on rank {plan.rank} of {num_ranks}" if num_ranks > 1 else ""


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
