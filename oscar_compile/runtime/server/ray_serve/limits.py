"""The engine's limits, sent from a replica to the ingress once, so that the ingress checks each
request with the engine's own code before any replica sees it.

Why not ask a replica per request: the server's checks (the engine's ``InputProcessor``: context
length, vocabulary, KV pages, ``n`` against ``max_num_seqs``) are synchronous calls made while the
request is parsed, and every answer they give depends only on numbers fixed when the engine was
built. So a replica sends those numbers (``EngineLimits``) and the ingress builds the same
``InputProcessor`` from them, over a ``PageManager`` of the same layout and pool sizes (it holds no
tensors): one implementation of the checks, whichever process runs it, and each request validated
once, at the ingress, into the ``EngineRequest`` a replica trusts.

All replicas of a deployment are built from the same flags, so one replica's limits are every
replica's (the ingress asks one, at its start).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oscar_compile.formats.cache import CacheLayout
from oscar_compile.runtime.core.config import RunnerCapabilities
from oscar_compile.runtime.core.page_manager import PageManager
from oscar_compile.runtime.engine import LLMEngine
from oscar_compile.runtime.input_processor import InputProcessor

# without window snapshots a hit may end at any cached page: route on boundaries this far apart
_ROUTING_INTERVAL_WITHOUT_SNAPSHOTS = 256


@dataclass(frozen=True)
class EngineLimits:
    """What the request checks of one engine read (picklable: it crosses to the ingress).
    ``routing_interval``: tokens between the prefix keys the router matches (the engine's
    snapshot interval; None without prefix caching: no affinity)."""

    tokenizer: Any
    max_model_len: int
    vocab_size: int
    capabilities: RunnerCapabilities
    max_num_seqs: int
    max_num_batched_tokens: int
    layout: CacheLayout
    num_window_pages: int
    num_quant_pages: int
    num_staging_pages: int
    eos_token_ids: tuple[int, ...]
    routing_interval: int | None

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineLimits:
        pm = engine.page_manager
        layout = pm.layout
        if not pm.enable_prefix_caching:
            interval = None
        elif pm.snapshots is not None:
            interval = pm.snapshots.interval
        else:
            interval = max(layout.page_size, _ROUTING_INTERVAL_WITHOUT_SNAPSHOTS // layout.page_size * layout.page_size)
        processor = engine.input_processor
        return cls(engine.tokenizer, processor.max_model_len, processor.vocab_size, processor.capabilities,
                   processor.max_num_seqs, processor.max_num_batched_tokens, layout,
                   pm.window_pool.num_pages, pm.quant_pool.num_pages, pm.staging_pool.num_pages,
                   tuple(sorted(engine.eos_token_ids)), interval)


class LimitsView:
    """What the server's handlers read of ``async_engine.engine``, rebuilt on the ingress from
    ``EngineLimits``: the engine's own ``InputProcessor`` over the same sizes."""

    def __init__(self, limits: EngineLimits):
        self.limits = limits
        self.tokenizer = limits.tokenizer
        self.max_model_len = limits.max_model_len
        pages = PageManager(limits.layout, limits.num_window_pages, limits.num_quant_pages,
                            num_staging_pages=limits.num_staging_pages)
        self.input_processor = InputProcessor(limits.vocab_size, limits.max_model_len, limits.max_num_seqs,
                                              limits.max_num_batched_tokens, pages, limits.capabilities)
        self._structured = None

    @property
    def structured_output(self):
        """A grammar compiler over the same tokenizer: a bad schema is a 400 at the ingress (the
        replica compiles it again, for its own masks)."""
        if self._structured is None:
            from oscar_compile.runtime.structured_output import xgrammar_manager

            self._structured = xgrammar_manager(self.tokenizer, self.limits.vocab_size, list(self.limits.eos_token_ids))
        return self._structured
