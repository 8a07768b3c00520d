"""Structured output at the engine's level, as vLLM's ``v1/structured_output/``: grammar backends
(``backend.py`` the interface, one module per engine: ``backend_xgrammar.py``), and the manager
that compiles off the engine thread, caches by ``StructuredOutputParams.key`` and keeps each
request's grammar (``manager.py``). The engine advances the grammars; the worker applies the
mask (``worker/grammar_mask.py``), after the logit controls and before sampling; logprobs stay
the model's own, before the mask (vLLM's default).

The order of a step (engine.py), with overlapped steps (the forward of step t+1 is queued before
the host reads step t's sample):

1. schedule; queue forward t+1 on the device (CUDA graphs replay as usual: the mask is not part
   of the captured forward), with the pending token t taken from the device;
2. if no sampled row of step t+1 has a grammar: queue sampling t+1 at once, as without
   structured output (requests without a constraint pay nothing: not even a bitmask);
3. else, while the device runs forward t+1, on the host: read step t's tokens (their copies were
   queued right after sample t, so this waits for sample t only), advance each grammar by its
   token t, fill the bitmask of step t+1 from the advanced states (pinned host memory), queue its
   copy to the device and the masked sampling t+1 behind the forward;
4. then the rest of step t's host work (stop checks, detokenizing, outputs); a grammar that
   terminated (took its stop token) stops its request with ``finish_reason`` ``stop``.

So the host's mask work overlaps the forward; the device waits only if filling the masks takes
longer than the forward. A request whose grammar is still compiling is held by the manager and
scheduled once it is ready; a compile error fails that request only (the server compiles before
admitting, so a bad schema or regex is a 400 naming its field).
"""

from __future__ import annotations

import importlib
import importlib.util

from oscar_compile.runtime.structured_output.backend import GrammarEngineUnavailable
from oscar_compile.runtime.structured_output.manager import StructuredOutputManager


def grammar_engine_installed() -> bool:
    """Whether xgrammar can be imported (checked without importing it: a server says at start
    that structured output is off)."""
    importlib.invalidate_caches()  # a package installed while the server runs is found
    return importlib.util.find_spec("xgrammar") is not None


def xgrammar_manager(tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None) -> StructuredOutputManager:
    """A manager over the xgrammar backend (imported at the first compile, so an engine that
    serves no constrained request never loads xgrammar)."""

    def make_backend():
        importlib.invalidate_caches()  # a package installed while the server runs is found
        from oscar_compile.runtime.structured_output.backend_xgrammar import XgrammarBackend

        return XgrammarBackend(tokenizer, vocab_size, stop_token_ids)

    return StructuredOutputManager(make_backend, vocab_size)


__all__ = ["GrammarEngineUnavailable", "StructuredOutputManager", "grammar_engine_installed", "xgrammar_manager"]
