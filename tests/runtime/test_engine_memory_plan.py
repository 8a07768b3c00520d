"""How the engine sizes its KV pages (engine_config._page_counts): the config's counts, the
``kv_memory_gb`` override, the profile-run plan on CUDA, today's default on the CPU.

The profile itself needs a GPU (tests/runtime/worker/test_memory_profile.py); here a factory's
``profile`` hands back given sizes, so the whole decision runs on the CPU."""
import pytest
import torch

from oscar_compile.formats.cache import CacheLayout
from oscar_compile.runtime.core.config import RunnerCapabilities
from oscar_compile.runtime.core.memory_plan import GIB, InsufficientMemoryError, MemoryProfile, largest_step
from oscar_compile.runtime.core.page_plan import plan_pages
from oscar_compile.runtime.engine_config import EngineConfig, _page_counts, later_pool_bytes
from oscar_compile.runtime.worker.runner import RunnerFactory

# 8B-shaped: 36 layers, 8 KV heads, D 128, INT2 history (G 128), S0 = W = 256... scaled to 4 layers
LAYOUT = CacheLayout.uniform(4, 8, 128, page_size=16, sink=64, recent=256, bits=2, group_size=128)
CUDA = torch.device("cuda")  # a device object only: nothing here touches CUDA
MAX_MODEL_LEN = 8192
CAPS = RunnerCapabilities(staging=True, prompt_logits=True, page_copies=True, prefill_semantics="decode-consistent")


class FakeProfile:
    """A factory's ``profile``: records what it was asked and returns the given profiles."""

    def __init__(self, *profiles: MemoryProfile):
        self.profiles, self.calls = list(profiles), []

    def __call__(self, page_manager, rows):
        self.calls.append((page_manager, rows))
        return self.profiles

    def factory(self, capabilities=CAPS) -> RunnerFactory:
        def build(page_manager):
            raise AssertionError("the planner builds no runner when the factory profiles itself")
        return RunnerFactory(capabilities, build, self)


def _own_bytes(num_bytes: int) -> MemoryProfile:
    """A 16 GiB device whose every byte in use is the engine's weights (nothing held elsewhere,
    the profile run adds nothing)."""
    return MemoryProfile(total=16 * GIB, before=num_bytes, peak_in_use=num_bytes, weights=num_bytes)


def _own(gib: int) -> MemoryProfile:
    return _own_bytes(gib * GIB)


def _counts(config, device=CUDA, profile: FakeProfile | None = None, capabilities=CAPS):
    factory = profile.factory(capabilities) if profile is not None else None
    return _page_counts(config, LAYOUT, MAX_MODEL_LEN, device, capabilities, factory)


def _planned(kv_bytes: int, config: EngineConfig) -> tuple[int, int]:
    plan = plan_pages(LAYOUT, kv_bytes, config.max_num_seqs, min(MAX_MODEL_LEN, 4096))
    return plan.num_window_pages, plan.num_quant_pages


def test_the_profile_plan_sizes_the_pages_on_cuda():
    config = EngineConfig(max_num_seqs=32, max_num_batched_tokens=4096, gpu_memory_utilization=0.8)
    # 3 GiB of weights beside 1 GiB held elsewhere; the profile run adds 2 GiB, half a GiB its pages
    fake = FakeProfile(MemoryProfile(total=16 * GIB, before=4 * GIB, peak_in_use=6 * GIB, profile_pools=GIB // 2,
                                     weights=3 * GIB))
    later = later_pool_bytes(config.cache, LAYOUT, CAPS, MAX_MODEL_LEN)
    assert later["staging pages"] == 0  # decode-consistent prefill stages nothing
    expected = int(0.8 * 16 * GIB) - (3 * GIB + 2 * GIB - GIB // 2) - sum(later.values())
    assert _counts(config, profile=fake) == _planned(expected, config)
    (probe, rows), = fake.calls
    # the profile runner holds one sequence of max_model_len; the step is the largest the config allows
    assert probe.window_pool.num_pages == LAYOUT.num_window_pages_per_seq
    assert probe.max_seq_len() >= MAX_MODEL_LEN
    assert rows == largest_step(32, 4096, MAX_MODEL_LEN)
    assert probe.swap_space is None  # no host swap for a runner that lives a moment


def test_more_utilization_gives_more_pages():
    fake = FakeProfile(_own(6))
    low = _counts(EngineConfig(gpu_memory_utilization=0.6), profile=fake)
    high = _counts(EngineConfig(gpu_memory_utilization=0.9), profile=fake)
    assert high[1] > low[1]


def test_kv_memory_overrides_the_plan():
    fake = FakeProfile(_own(6))
    config = EngineConfig(kv_memory_gb=2.0, gpu_memory_utilization=0.5)
    assert _counts(config, profile=fake) == _planned(2 * GIB, config)
    (_, rows), = fake.calls  # the profile run checked the override: the largest step, as for the plan
    assert rows == largest_step(config.max_num_seqs, config.max_num_batched_tokens, MAX_MODEL_LEN)
    counts = EngineConfig(num_window_pages=7, num_quant_pages=9)
    assert _counts(counts, profile=fake) == (7, 9) and len(fake.calls) == 1
    assert _counts(config, device=torch.device("cpu"), profile=fake) == _planned(2 * GIB, config)
    assert len(fake.calls) == 1  # the CPU is not profiled


def test_a_kv_memory_that_does_not_fit_beside_the_step_stops_the_start():
    """All of the device but the weights and the largest step is free for the override; one byte
    more is refused with the largest budget that fits (the plan's share plays no part in it)."""
    config = EngineConfig(kv_memory_gb=10.0)
    later = sum(later_pool_bytes(config.cache, LAYOUT, CAPS, MAX_MODEL_LEN).values())
    exact = FakeProfile(_own_bytes(6 * GIB - later))  # 6 GiB in use with the later pools: 10 GiB left
    assert _counts(config, profile=exact) == _planned(10 * GIB, config)
    refused = (r"--kv-memory 10\.00 GiB beside the weights and the largest step .* needs 16\.00 GiB, but 16\.00 GiB of "
               r"the device's 16\.00 GiB is free for this engine: --kv-memory 9\.99 would fit")
    with pytest.raises(InsufficientMemoryError, match=refused):
        _counts(config, profile=FakeProfile(_own_bytes(6 * GIB - later + 2**20)))
    held = MemoryProfile(total=16 * GIB, before=9 * GIB, peak_in_use=9 * GIB, weights=2 * GIB)  # 7 GiB elsewhere
    with pytest.raises(InsufficientMemoryError, match=r"on rank 1 of 2: .*9\.00 GiB of the device's 16\.00 GiB is "
                                                      r"free for this engine"):
        _counts(EngineConfig(kv_memory_gb=8.0), profile=FakeProfile(_own(6), held))


def test_the_plan_is_the_default_on_cuda(monkeypatch):
    """No budget given: on CUDA a profile run and 0.9 of the device, as vLLM plans it (a GPU test
    session sets no share by default, tests/conftest.py: the library's is put back here)."""
    from oscar_compile.runtime.core import config as core_config

    monkeypatch.setattr(core_config, "GPU_MEMORY_UTILIZATION", 0.9)
    fake = FakeProfile(_own(6))
    config = EngineConfig()
    assert config.cache.gpu_memory_utilization == 0.9
    later = sum(later_pool_bytes(config.cache, LAYOUT, CAPS, MAX_MODEL_LEN).values())
    assert _counts(config, profile=fake) == _planned(int(0.9 * 16 * GIB) - 6 * GIB - later, config)
    assert len(fake.calls) == 1


def test_without_a_share_cuda_takes_half_the_free_memory(monkeypatch):
    """``gpu_memory_utilization=None`` turns the plan off: no profile run, the default before it."""
    from oscar_compile.runtime import engine_config

    monkeypatch.setattr(engine_config, "default_kv_memory_bytes", lambda device: 3 * GIB)
    fake = FakeProfile(_own(6))
    config = EngineConfig(gpu_memory_utilization=None)
    assert _counts(config, profile=fake) == _planned(3 * GIB, config)
    assert fake.calls == []


def test_the_cpu_keeps_todays_default():
    fake = FakeProfile(_own(6))
    config = EngineConfig(gpu_memory_utilization=0.5)
    assert _counts(config, device=torch.device("cpu"), profile=fake) == _planned(GIB, config)
    assert fake.calls == []


def test_tensor_parallel_plans_from_the_tightest_rank():
    config = EngineConfig(gpu_memory_utilization=0.9)
    ranks = FakeProfile(_own(5), _own(7), _own(6))
    later = sum(later_pool_bytes(config.cache, LAYOUT, CAPS, MAX_MODEL_LEN).values())
    assert _counts(config, profile=ranks) == _planned(int(0.9 * 16 * GIB) - 7 * GIB - later, config)


def test_prompt_exact_staging_comes_out_of_the_share():
    caps = RunnerCapabilities(staging=True, prompt_logits=True, prefill_semantics="prompt-exact")
    exact = EngineConfig(prefill_semantics="prompt-exact", gpu_memory_utilization=0.9)
    later = later_pool_bytes(exact.cache, LAYOUT, caps, MAX_MODEL_LEN)
    history_pages = LAYOUT.num_quant_pages_for(LAYOUT.num_history_tokens(MAX_MODEL_LEN))
    assert later["staging pages"] == history_pages * LAYOUT.window_page_bytes  # one prompt of the context length
    fixed = later_pool_bytes(EngineConfig(prefill_semantics="prompt-exact", prefill_staging_memory_gb=0.25).cache,
                             LAYOUT, caps, MAX_MODEL_LEN)
    assert fixed["staging pages"] == int(0.25 * GIB) // LAYOUT.window_page_bytes * LAYOUT.window_page_bytes
    fake = FakeProfile(_own(6))
    expected = int(0.9 * 16 * GIB) - 6 * GIB - sum(later.values())
    assert _counts(exact, profile=fake, capabilities=caps) == _planned(expected, exact)


def test_too_little_left_stops_the_start_with_the_numbers():
    one_seq = (LAYOUT.num_window_pages_per_seq * LAYOUT.window_page_bytes
               + LAYOUT.num_quant_pages_for(LAYOUT.num_history_tokens(MAX_MODEL_LEN)) * LAYOUT.quant_page_bytes)
    config = EngineConfig(gpu_memory_utilization=0.9)
    later = sum(later_pool_bytes(config.cache, LAYOUT, CAPS, MAX_MODEL_LEN).values())
    in_use = int(0.9 * 16 * GIB) - later - one_seq  # leaves exactly one sequence
    assert _counts(config, profile=FakeProfile(_own_bytes(in_use)))[0] == LAYOUT.num_window_pages_per_seq
    fake = FakeProfile(_own_bytes(in_use + 1))  # one byte short
    with pytest.raises(InsufficientMemoryError, match=r"asks for 14\.40 GiB of 16\.00 GiB.*one sequence of "
                                                      r"max_model_len 8192 needs .*--gpu-memory-utilization 0\.91"):
        _counts(config, profile=fake)


def test_a_rank_whose_share_is_not_free_stops_the_start():
    held = MemoryProfile(total=16 * GIB, before=9 * GIB, peak_in_use=10 * GIB, weights=2 * GIB)  # 7 GiB elsewhere
    with pytest.raises(InsufficientMemoryError, match=r"on rank 1 of 2: .*asks for 14\.40 GiB of 16\.00 GiB, but "
                                                      r"7\.00 GiB is held outside this engine.*utilization 0\.56"):
        _counts(EngineConfig(gpu_memory_utilization=0.9), profile=FakeProfile(_own(6), held))
    assert _counts(EngineConfig(gpu_memory_utilization=0.5), profile=FakeProfile(_own(6), held))[1] > 0
