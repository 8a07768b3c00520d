"""The engine's limits, sent from a replica to the ingress once, so that the ingress checks each
request with the engine's own code before any replica sees it.

Why not ask a replica per request: the server's checks (``validate_request``, ``max_new_tokens``:
context length, vocabulary, KV pages, ``n`` against ``max_num_seqs``) are synchronous calls made
while the request is parsed, and every answer they give depends only on numbers fixed when the
engine was built. So a replica sends those numbers (``EngineLimits``) and the ingress rebuilds
what the checks read: a ``PageManager`` of the same layout and pool sizes (it holds no tensors)
and the runner's and scheduler's settings. ``LimitsView`` then runs ``LLMEngine``'s own methods
on them: one implementation of the checks, whichever process runs it.

All replicas of a deployment are built from the same flags, so one replica's limits are every
replica's (the ingress asks one, at its start).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from oscar_compile.formats.cache import CacheLayout
from oscar_compile.runtime.core.page_manager import PageManager
from oscar_compile.runtime.engine import LLMEngine

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
    supports_prompt_logits: bool
    can_fork: bool
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
        pm, runner = engine.page_manager, engine.runner
        layout = pm.layout
        if not pm.enable_prefix_caching:
            interval = None
        elif pm.snapshots is not None:
            interval = pm.snapshots.interval
        else:
            interval = max(layout.page_size, _ROUTING_INTERVAL_WITHOUT_SNAPSHOTS // layout.page_size * layout.page_size)
        return cls(engine.tokenizer, engine.max_model_len, runner.vocab_size,
                   bool(getattr(runner, "supports_prompt_logits", False)), hasattr(runner, "copy_pages"),
                   engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens, layout,
                   pm.window_pool.num_pages, pm.quant_pool.num_pages, pm.staging_pool.num_pages,
                   tuple(sorted(engine.eos_token_ids)), interval)


class _Runner(SimpleNamespace):
    """The runner's settings the checks read; ``copy_pages`` exists only where the runner has it."""


class LimitsView:
    """What the server's handlers read of ``async_engine.engine``, rebuilt on the ingress from
    ``EngineLimits``: ``validate_request`` and ``max_new_tokens`` are ``LLMEngine``'s own."""

    def __init__(self, limits: EngineLimits):
        self.limits = limits
        self.tokenizer = limits.tokenizer
        self.max_model_len = limits.max_model_len
        self.runner = _Runner(vocab_size=limits.vocab_size, supports_prompt_logits=limits.supports_prompt_logits)
        if limits.can_fork:
            self.runner.copy_pages = None  # only its presence is read (n > 1)
        self.scheduler = SimpleNamespace(max_num_seqs=limits.max_num_seqs,
                                         max_num_batched_tokens=limits.max_num_batched_tokens)
        self.page_manager = PageManager(limits.layout, limits.num_window_pages, limits.num_quant_pages,
                                        num_staging_pages=limits.num_staging_pages)
        self._structured = None

    validate_request = LLMEngine.validate_request
    max_new_tokens = LLMEngine.max_new_tokens

    @property
    def structured_output(self):
        """A grammar compiler over the same tokenizer: a bad schema is a 400 at the ingress (the
        replica compiles it again, for its own masks)."""
        if self._structured is None:
            from oscar_compile.runtime.structured_output import xgrammar_manager

            self._structured = xgrammar_manager(self.tokenizer, self.limits.vocab_size, list(self.limits.eos_token_ids))
        return self._structured
