"""What a prompt token reads from the cache: the two prefill semantics, named once (torch-free).

- ``prompt-exact``: a prefill chunk attends to its own tokens in full precision,
  as ``generate()`` does over a whole prompt; the cache is read as it stands when the chunk runs
  (chunked prefill stages the history unquantized so that later chunks match, page_manager,
  "Deferred demotion"). A prompt token then sees more precision than a decode step at its
  position would, so prefill and decode of the same tokens differ by the INT-b rounding.
- ``decode-consistent`` (the default): every prompt token reads the cache exactly as a decode step at its
  position p would: the sink ``[0, S0)`` and the recent window ``[p - W, p)`` at window
  precision, the history ``[S0, p - W)`` quantized (quantize-dequantize as ``cache_write``
  quantizes, the chunk's own tokens included), and its own key and value as computed. Prefill
  is then a teacher-forced decode: chunking, batching, recomputing after a preemption and
  prefix hits that restore the window give what the decode steps gave.

The vLLM-style flag is ``--prefill-semantics`` (``EngineConfig.prefill_semantics``); the
evaluation's option of the same name simulates the same rule (evaluation/quantizers.py).

``DEFAULT_PREFILL_SEMANTICS`` is the one default that the engine, the server's flag, the
evaluation and ``generate()`` on a model rewritten by ``apply`` all read (tests/formats/
test_prefill_defaults.py holds them to it). It is decode-consistent since the rule of issue #31
was met at full size (eval/results/2026-12-03-h200-prefill-semantics/): perplexity at 4k within
0.3 % of prompt-exact (-0.072 % +- 0.124 %, 64 windows) and needle accuracy within 0.01 at every
length (identical, prompt for prompt), with exact prefix hits at window snapshots.
"""

from __future__ import annotations

PROMPT_EXACT = "prompt-exact"
DECODE_CONSISTENT = "decode-consistent"
PREFILL_SEMANTICS = (PROMPT_EXACT, DECODE_CONSISTENT)
DEFAULT_PREFILL_SEMANTICS = DECODE_CONSISTENT


def check_prefill_semantics(value: str) -> str:
    """``value`` if it names a semantics, else ValueError listing the choices."""
    if value not in PREFILL_SEMANTICS:
        raise ValueError(f"prefill semantics must be one of {PREFILL_SEMANTICS}, got {value!r}")
    return value
