"""Deterministic mode on the GPU under decode-consistent prefill, the default (marker ``gpu``).

The cases of test_deterministic.py's CPU tests, on CUDA with CUDA graphs on: the bundled model
as served (oscar-int2), alone against together, joining a running batch, prefilled in 128-token
chunks beside other requests' decode steps, resent (hits at window snapshots past the sink), and
preempted by recompute (generated tokens included). Bitwise, by construction:

- chunks: the decode-consistent Triton kernel reads key blocks at absolute positions in
  deterministic mode (``ALIGNED``), so a prompt row's bits do not depend on its chunk, and the
  views it reads are those the write kernel stores (bitwise the reference quantizer's);
- one-token calls (decode rows, graphs or eager) run the deterministic decode kernel; the
  scheduler computes a position by a one-token call in every run or in none
  (``PageManager.make_deterministic``: prompt chunks of 2 tokens or more, recomputed generated
  tokens one per step).
"""

from __future__ import annotations

import pytest
from test_deterministic import PARAMS, _joined, _llm, _prompts, _results

from oscar_compile.loading import BUNDLED_MODEL_DIR
from oscar_compile.runtime import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (BUNDLED_MODEL_DIR / "config.json").exists(), reason="no bundled model"),
]
DC = dict(prefill_semantics="decode-consistent")


def test_alone_together_joined_and_chunked_on_the_gpu():
    prompts = _prompts()
    llm = _llm("oscar-int2", "cuda", **DC)
    alone = [_results(llm.generate([p], PARAMS))[0] for p in prompts]
    assert _results(llm.generate(prompts, PARAMS)) == alone
    assert _joined(llm, prompts) == alone
    chunks = _llm("oscar-int2", "cuda", max_num_batched_tokens=128, **DC)
    assert _results(chunks.generate(prompts, PARAMS)) == alone


def test_resent_and_recomputed_on_the_gpu():
    prompts = _prompts()
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0)
    llm = _llm("oscar-int2", "cuda", enable_prefix_caching=True, **DC)
    alone = [_results(llm.generate([p], params))[0] for p in prompts]
    resent = llm.generate(prompts, params)  # every prompt hits its own window snapshots
    assert _results(resent) == alone
    assert max(o.num_cached_tokens for o in resent) > 64 + 256
    tight = _llm("oscar-int2", "cuda", num_window_pages=60, num_quant_pages=16, max_num_batched_tokens=128,
                 swap_space_gb=0, **DC)  # fmt: skip
    assert _results(tight.generate(prompts, params)) == alone
    assert tight.engine.stats()["num_recompute_preemptions"] >= 1
