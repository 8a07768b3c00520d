"""The frozen configs (core/config.py), the ``EngineConfig`` facade over them, the CLI's flags
built into the same configs, and a runner's declared capabilities."""
import dataclasses

import pytest

from oscar_compile.cli.serve import engine_config, parse_args
from oscar_compile.runtime.core import config as core_config
from oscar_compile.runtime.core.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    CacheConfig,
    RunnerCapabilities,
    RunnerConfig,
    SchedulerConfig,
)
from oscar_compile.runtime.engine_config import EngineConfig
from oscar_compile.runtime.worker.runner import RecomputeRunner


def test_the_facade_routes_each_keyword_to_its_frozen_config():
    config = EngineConfig(seed=7, prefix_hits="sink", deterministic=True, max_num_seqs=3, kv_memory_gb=0.5)
    assert config.runner == RunnerConfig(seed=7, deterministic=True)
    assert config.scheduler == SchedulerConfig(max_num_seqs=3)
    assert config.cache == CacheConfig(prefix_hits="sink", kv_memory_gb=0.5)
    assert (config.seed, config.max_num_seqs, config.prefix_hits) == (7, 3, "sink")  # read back flat
    for frozen in (config, config.cache, config.scheduler, config.runner):
        with pytest.raises(dataclasses.FrozenInstanceError):
            frozen.seed = 1
    with pytest.raises(TypeError, match="unknown settings"):
        EngineConfig(max_num_seq=3)
    with pytest.raises(AttributeError):
        config.max_num_seq  # noqa: B018


def test_replace_keeps_the_other_settings():
    config = dataclasses.replace(EngineConfig(seed=3, max_num_batched_tokens=16), layout=None, cuda_graphs=False)
    assert (config.seed, config.max_num_batched_tokens, config.cuda_graphs) == (3, 16, False)
    assert config.cache.gpu_memory_utilization == core_config.GPU_MEMORY_UTILIZATION


def test_the_default_share_is_vllms():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU test session plans no share by default (tests/conftest.py)")
    assert core_config.GPU_MEMORY_UTILIZATION == 0.9
    assert CacheConfig().gpu_memory_utilization == EngineConfig().cache.gpu_memory_utilization == 0.9
    assert engine_config(parse_args([])).cache.gpu_memory_utilization == 0.9


def test_checks_run_when_a_config_is_made():
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="deterministic"):  # across two configs: the facade checks it
        EngineConfig(deterministic=True, max_num_batched_tokens=2)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=1.5)
    assert CacheConfig(prefill_semantics="prompt-exact").prefix_hits == "history"  # resolved once, frozen


def test_the_cli_leaves_defaults_to_the_configs():
    config = engine_config(parse_args([]))
    assert config == EngineConfig()
    assert config.max_num_seqs == DEFAULT_MAX_NUM_SEQS
    assert config.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    flags = engine_config(parse_args(["--max-num-seqs", "5", "--no-overlap", "--prefix-hits", "sink"]))
    assert flags == EngineConfig(max_num_seqs=5, overlap_steps=False, prefix_hits="sink")


def test_the_memory_flags_reach_the_cache_config():
    config = engine_config(parse_args(["--gpu-memory-utilization", "0.75"]))
    assert (config.cache.gpu_memory_utilization, config.cache.kv_memory_gb) == (0.75, None)
    both = engine_config(parse_args(["--gpu-memory-utilization", "0.5", "--kv-memory", "3"]))
    assert (both.gpu_memory_utilization, both.kv_memory_gb) == (0.5, 3.0)  # the override is kept beside it
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        engine_config(parse_args(["--gpu-memory-utilization", "0"]))


def test_runners_declare_their_capabilities():
    from oscar_compile.runtime.worker.compressed_runner import CompressedRunner, runner_factory

    assert RecomputeRunner.capabilities == RunnerCapabilities(history_hits=True, prompt_logits=True,
                                                              page_copies=True)
    caps = CompressedRunner.capabilities_for("prompt-exact")
    assert caps.pending_tokens and caps.staging and caps.swapping and caps.prefill_semantics == "prompt-exact"
    factory = runner_factory(None, None, EngineConfig(prefill_semantics="prompt-exact"))
    assert factory.capabilities == caps
