"""Serving runtime: paged KV cache bookkeeping, continuous batching, sampling, OpenAI server.

Modelled on nano-vllm's split (sequence, block_manager, scheduler, model runner). Importing this
package is cheap: the public names below load their modules (and torch) on first use, and the
server (FastAPI) is only imported by ``oscar_compile.runtime.server`` / ``serve``.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "llm",
    "CompletionOutput": "llm",
    "LLMEngine": "engine",
    "RequestOutput": "engine",
    "SamplingParams": "sampling_params",
    "RequestError": "sampling_params",
    "CacheLayout": "page_plan",
    "LayerFormat": "page_plan",
    "plan_pages": "page_plan",
    "BlockManager": "block_manager",
    "Scheduler": "scheduler",
    "Sequence": "sequence",
    "Batch": "runner",
    "ModelRunner": "runner",
    "RecomputeRunner": "runner",
    "EngineConfig": "loader",
    "build_engine": "loader",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
