"""Serving runtime: paged KV cache bookkeeping, continuous batching, sampling, OpenAI server.

Rooms, as vLLM v1 keeps them, with imports one way (server -> engine -> core / worker, worker ->
core for types, then cache / kernels; tests/test_import_rules.py holds the rule):

- ``core/``: sequences, sampling parameters, the scheduler, pages, swap and staging bookkeeping
  (plain Python, no tensors: nano-vllm's sequence, block manager and scheduler);
- ``worker/``: what touches the device: the model worker (forward, prompt scores, sampling:
  ``model_worker``), the model runners, step inputs, CUDA graphs, the sampler, the swapper,
  staged attention and the tensor-parallel runner;
- here: the engine loop (``engine``: it schedules and hands out outputs; ``async_engine``), the
  one validation of a request (``input_processor``), detokenizing and stop checks
  (``output_processor``, ``detokenizer``), the stats (``stats``) and ``engine_config``
  (``EngineConfig``, the facade over core/config.py's frozen configs, and ``build_engine``);
  ``structured_output/``, the grammar backends and their manager, at the engine's level;
- ``server/``: the OpenAI protocol models, an OpenAI request validated into engine requests
  (``requests``), the app factory and routes, admission and shutdown.

Importing this package is cheap: the public names below load their modules (and torch) on first
use, and the server (FastAPI) is only imported by ``oscar_compile.runtime.server.app`` / ``serve``.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "llm",
    "CompletionOutput": "llm",
    "RequestOutput": "llm",  # LLM.generate's, one per prompt (the engine's per-step one: output_processor)
    "LLMEngine": "engine",
    "SamplingParams": "core.sampling_params",
    "StructuredOutputParams": "core.sampling_params",
    "RequestError": "core.sampling_params",
    "CacheLayout": "core.page_plan",
    "LayerFormat": "core.page_plan",
    "plan_pages": "core.page_plan",
    "PageManager": "core.page_manager",
    "Scheduler": "core.scheduler",
    "Sequence": "core.sequence",
    "Batch": "worker.runner",
    "ModelRunner": "worker.runner",
    "RecomputeRunner": "worker.runner",
    "EngineConfig": "engine_config",
    "EngineRequest": "input_processor",
    "EngineStats": "stats",
    "CacheConfig": "core.config",
    "SchedulerConfig": "core.config",
    "RunnerConfig": "core.config",
    "RunnerCapabilities": "core.config",
    "build_engine": "engine_config",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
