"""The memory planner (core/memory_plan.py): from measured sizes, the KV budget and its refusals."""
import pytest

from oscar_compile.runtime.core.memory_plan import (
    GIB,
    InsufficientMemoryError,
    MemoryProfile,
    StepRow,
    check_override,
    checked_kv_bytes,
    largest_step,
    plan_memory,
    smallest,
)

TOTAL = 80 * GIB


def _profile(weights=16, others=1, step=4, pools=1, total=TOTAL):
    """GiB: ``weights`` loaded beside ``others`` held outside the engine; the profile run adds
    ``step`` (graph pools, buffers, the step's peak) and its runner's ``pools``."""
    before = (weights + others) * GIB
    return MemoryProfile(total=total, before=before, peak_in_use=before + (step + pools) * GIB,
                         profile_pools=pools * GIB, weights=weights * GIB)


def test_the_budget_is_the_share_less_the_engines_own_and_the_later_pools():
    plan = plan_memory(_profile(), 0.9, {"staging pages": 2 * GIB, "scratch pages": 1 * GIB})
    assert plan.requested == int(0.9 * TOTAL)
    assert (plan.own, plan.others) == (20 * GIB, 1 * GIB)  # weights + step; the pages are replaced
    assert plan.non_kv == 23 * GIB
    assert plan.kv_bytes == int(0.9 * TOTAL) - 23 * GIB
    assert plan_memory(_profile(), 0.5).kv_bytes == 40 * GIB - 20 * GIB  # no later pools
    assert plan_memory(_profile(), 1.0).kv_bytes == 60 * GIB


def test_memory_held_outside_the_engine_does_not_shrink_its_share():
    """As vLLM: another engine's 30 GiB leaves this one's 0.5 share whole (it is free)."""
    alone, beside = plan_memory(_profile(), 0.5), plan_memory(_profile(others=30), 0.5)
    assert alone.kv_bytes == beside.kv_bytes
    assert checked_kv_bytes([beside], GIB, "one sequence") == beside.kv_bytes


def test_each_later_pool_counts_once():
    without = plan_memory(_profile(), 0.9).kv_bytes
    assert without - plan_memory(_profile(), 0.9, {"staging pages": 5 * GIB}).kv_bytes == 5 * GIB
    assert without - plan_memory(_profile(), 0.9, {"a": GIB, "b": 2 * GIB}).kv_bytes == 3 * GIB


def test_tensor_parallel_takes_the_smallest_remainder():
    ranks = [_profile(step=4), _profile(step=7), _profile(step=5, others=3)]
    plans = [plan_memory(p, 0.9, {"scratch pages": GIB}, rank=i) for i, p in enumerate(ranks)]
    tight = smallest(plans)
    assert tight.rank == 1
    assert tight.kv_bytes == int(0.9 * TOTAL) - (16 + 7) * GIB - GIB
    assert checked_kv_bytes(plans, GIB, "one sequence") == tight.kv_bytes == min(p.kv_bytes for p in plans)
    # a rank with a smaller device decides even when it holds less
    small = plan_memory(_profile(weights=8, total=40 * GIB), 0.9, rank=3)
    assert smallest(plans + [small]) is small
    with pytest.raises(ValueError):
        smallest([])


def test_too_small_a_remainder_says_what_was_asked_for_and_what_fits():
    plan = plan_memory(_profile(weights=60, step=8), 0.9, {"staging pages": 2 * GIB})
    assert plan.kv_bytes == 2 * GIB
    with pytest.raises(InsufficientMemoryError) as err:
        checked_kv_bytes([plan], 4 * GIB, "one sequence of max_model_len 40960")
    text = str(err.value)
    assert "--gpu-memory-utilization 0.9 asks for 72.00 GiB of 80.00 GiB" in text
    assert "take 68.00 GiB" in text and "staging pages 2.00 GiB" in text
    assert "leaves 2.00 GiB for the KV cache" in text
    assert "one sequence of max_model_len 40960 needs 4.00 GiB" in text
    # (68 + 2 + 4) / 80 = 0.925, rounded up to a hundredth
    assert "--gpu-memory-utilization 0.93 would fit it" in text
    assert isinstance(err.value, ValueError)  # the serve command prints it and exits 2


def test_a_device_too_small_for_the_minimum_says_so():
    plan = plan_memory(_profile(weights=70, step=6), 0.9, rank=1)
    assert plan.kv_bytes < 0
    with pytest.raises(InsufficientMemoryError, match="on rank 1 of 2.*leaves nothing.*even all of the 79.00 GiB"):
        checked_kv_bytes([plan_memory(_profile(), 0.9), plan], 4 * GIB, "one sequence")


def test_a_share_that_is_not_free_is_refused():
    """vLLM's check of the free memory at start: 40 GiB held elsewhere leave 40 of 80 GiB."""
    plans = [plan_memory(_profile(), 0.9), plan_memory(_profile(others=40), 0.9, rank=1)]
    with pytest.raises(InsufficientMemoryError, match=r"on rank 1 of 2: --gpu-memory-utilization 0\.9 asks for "
                                                      r"72\.00 GiB of 80\.00 GiB, but 40\.00 GiB is held outside "
                                                      r".*leaves 40\.00 GiB: --gpu-memory-utilization 0\.50 would"):
        checked_kv_bytes(plans, GIB, "one sequence")
    assert checked_kv_bytes([plan_memory(_profile(others=40), 0.5)], GIB, "one sequence") > GIB


def test_a_kv_memory_override_fits_what_the_engine_does_not_hold():
    """``--kv-memory``: the device less what is held outside the engine, its own memory at the
    profile run's peak and the later pools; the share (utilization) plays no part."""
    plan = plan_memory(_profile(), 1.0, {"staging pages": 2 * GIB}, rank=1)  # 80 - 1 elsewhere - 20 own - 2 later
    check_override([plan], 57 * GIB)
    with pytest.raises(InsufficientMemoryError) as err:
        check_override([plan_memory(_profile(), 1.0), plan], 58 * GIB)  # rank 0 (59 GiB free) would hold it
    text = str(err.value)
    assert "on rank 1 of 2: --kv-memory 58.00 GiB beside the weights and the largest step (20.00 GiB" in text
    assert "staging pages 2.00 GiB) needs 80.00 GiB, but 79.00 GiB of the device's 80.00 GiB" in text
    assert "--kv-memory 57.00 would fit" in text
    with pytest.raises(InsufficientMemoryError, match="no KV budget fits: lower --max-num-batched-tokens"):
        check_override([plan_memory(_profile(weights=70, step=9), 1.0)], GIB)
    with pytest.raises(ValueError, match=">= 0"):
        check_override([plan], -1)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_memory(_profile(), 0.0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_memory(_profile(), 1.2)
    with pytest.raises(ValueError, match="profile pools"):
        MemoryProfile(TOTAL, GIB, 2 * GIB, profile_pools=2 * GIB)
    with pytest.raises(ValueError, match="weights"):
        MemoryProfile(TOTAL, GIB, 2 * GIB, weights=2 * GIB)
    with pytest.raises(ValueError, match="before the profile run"):
        MemoryProfile(TOTAL, 3 * GIB, 2 * GIB)
    with pytest.raises(ValueError, match=">= 0"):
        plan_memory(_profile(), 0.9, {"x": -1})


@pytest.mark.parametrize("seqs,tokens,context", [(64, 8192, 40960), (32, 8192, 4096), (4, 8192, 1000),
                                                 (256, 100, 512), (1, 1, 1), (3, 10, 2)])
def test_the_largest_step_fills_the_token_budget_at_the_longest_context(seqs, tokens, context):
    rows = largest_step(seqs, tokens, context)
    assert len(rows) == min(seqs, tokens)
    assert all(r.cache_len + r.num_new == context and 1 <= r.num_new <= context for r in rows)
    assert sum(r.num_new for r in rows) == min(tokens, len(rows) * context)


def test_the_largest_step_puts_the_chunks_first():
    assert largest_step(4, 10, 5) == [StepRow(0, 5), StepRow(2, 3), StepRow(4, 1), StepRow(4, 1)]
    assert largest_step(2, 8192, 40960) == [StepRow(40960 - 8191, 8191), StepRow(40959, 1)]
    with pytest.raises(ValueError):
        largest_step(0, 8, 8)
