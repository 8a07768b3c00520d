"""The memory planner (core/memory_plan.py): from measured sizes, the KV budget and its refusals."""
import pytest

from oscar_compile.runtime.core.memory_plan import (
    GIB,
    InsufficientMemoryError,
    MemoryProfile,
    StepRow,
    checked_kv_bytes,
    largest_step,
    plan_memory,
    smallest,
)

TOTAL = 80 * GIB


def test_the_budget_is_the_share_less_what_the_profile_and_the_later_pools_take():
    # 20 GiB in use at the peak, 1 GiB of it the profile runner's pages; 3 GiB of pools come later
    profile = MemoryProfile(total=TOTAL, peak_in_use=20 * GIB, profile_pools=1 * GIB)
    plan = plan_memory(profile, 0.9, {"staging pages": 2 * GIB, "scratch pages": 1 * GIB})
    assert plan.requested == int(0.9 * TOTAL)
    assert plan.in_use == 19 * GIB
    assert plan.non_kv == 22 * GIB
    assert plan.kv_bytes == int(0.9 * TOTAL) - 22 * GIB
    assert plan_memory(profile, 0.5).kv_bytes == 40 * GIB - 19 * GIB  # no later pools
    assert plan_memory(profile, 1.0).kv_bytes == 61 * GIB


def test_each_later_pool_counts_once():
    profile = MemoryProfile(total=TOTAL, peak_in_use=10 * GIB)
    without = plan_memory(profile, 0.9).kv_bytes
    assert without - plan_memory(profile, 0.9, {"staging pages": 5 * GIB}).kv_bytes == 5 * GIB
    assert without - plan_memory(profile, 0.9, {"a": GIB, "b": 2 * GIB}).kv_bytes == 3 * GIB


def test_tensor_parallel_takes_the_smallest_remainder():
    ranks = [MemoryProfile(TOTAL, 30 * GIB), MemoryProfile(TOTAL, 34 * GIB, GIB), MemoryProfile(TOTAL, 31 * GIB)]
    plans = [plan_memory(p, 0.9, {"scratch pages": GIB}, rank=i) for i, p in enumerate(ranks)]
    tight = smallest(plans)
    assert tight.rank == 1
    assert tight.kv_bytes == int(0.9 * TOTAL) - 33 * GIB - GIB
    assert tight.kv_bytes == min(p.kv_bytes for p in plans)
    # a rank with a smaller device decides even when it holds less
    small = plan_memory(MemoryProfile(40 * GIB, 20 * GIB), 0.9, rank=3)
    assert smallest(plans + [small]) is small
    with pytest.raises(ValueError):
        smallest([])


def test_a_remainder_that_holds_the_minimum_is_returned():
    plan = plan_memory(MemoryProfile(TOTAL, 20 * GIB), 0.9)
    assert checked_kv_bytes(plan, 10 * GIB, "one sequence") == plan.kv_bytes


def test_too_small_a_remainder_says_what_was_asked_for_and_what_fits():
    plan = plan_memory(MemoryProfile(TOTAL, 70 * GIB, GIB), 0.9, {"staging pages": GIB})
    assert plan.kv_bytes == 2 * GIB
    with pytest.raises(InsufficientMemoryError) as err:
        checked_kv_bytes(plan, 4 * GIB, "one sequence of max_model_len 40960")
    text = str(err.value)
    assert "--gpu-memory-utilization 0.9 asks for 72.00 GiB of 80.00 GiB" in text
    assert "take 69.00 GiB" in text and "staging pages 1.00" in text
    assert "leaves 2.00 GiB for the KV cache" in text
    assert "one sequence of max_model_len 40960 needs 4.00 GiB" in text
    # 70 GiB + 4 GiB of 80: 0.925, rounded up to a hundredth
    assert "--gpu-memory-utilization 0.93 would fit it" in text
    assert isinstance(err.value, ValueError)  # the serve command prints it and exits 2


def test_a_device_too_small_for_any_share_says_so():
    plan = plan_memory(MemoryProfile(TOTAL, 79 * GIB), 0.9, rank=1)
    assert plan.kv_bytes < 0
    with pytest.raises(InsufficientMemoryError, match="on rank 1 of 2.*leaves nothing.*even the whole device"):
        checked_kv_bytes(plan, 2 * GIB, "one sequence", num_ranks=2)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_memory(MemoryProfile(TOTAL, GIB), 0.0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_memory(MemoryProfile(TOTAL, GIB), 1.2)
    with pytest.raises(ValueError, match="profile pools"):
        MemoryProfile(TOTAL, GIB, 2 * GIB)
    with pytest.raises(ValueError, match=">= 0"):
        plan_memory(MemoryProfile(TOTAL, GIB), 0.9, {"x": -1})


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
