"""The evaluation's ``--prefill-semantics``: the cache schedule it simulates, and the perplexity's
per-window numbers that let two semantics be compared pairwise."""

import math

import pytest
import torch

from oscar_compile.evaluation.config import EvalConfig
from oscar_compile.evaluation.quantizers import cache_starts
from oscar_compile.evaluation.tasks import perplexity
from oscar_compile.formats.prefill import DECODE_CONSISTENT, PROMPT_EXACT


def test_decode_consistent_schedule_is_the_teacher_forced_decode():
    """Whatever the chunks, each position reads the cache a decode step at it would read."""
    prompt_exact = cache_starts(8, prefill=torch.tensor([3, 0]), chunk=torch.tensor([2, 0]))
    decode = cache_starts(8, prefill=torch.tensor([3, 0]), chunk=torch.tensor([2, 0]), semantics=DECODE_CONSISTENT)
    assert prompt_exact.tolist() == [[0, 0, 0, 3, 3, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert decode.tolist() == [list(range(8))]


def test_unknown_semantics_is_refused():
    with pytest.raises(ValueError, match="prefill semantics"):
        cache_starts(4, semantics="exact")
    with pytest.raises(ValueError, match="prefill semantics"):
        EvalConfig(prefill_semantics="decode")


def test_perplexity_reports_each_window_and_the_standard_error():
    from oscar_compile.testing import tiny_model

    model = tiny_model("qwen3", num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, vocab_size=32, seed=0)
    windows = torch.randint(0, 32, (5, 12), generator=torch.Generator().manual_seed(0))
    out = perplexity(model, {"bf16": [None]}, windows, ppl_tokens=4, batch_size=2, semantics=PROMPT_EXACT)["bf16"]
    values = out["window_nll"]
    assert len(values) == 5 and out["tokens"] == 20
    mean = sum(values) / 5
    assert out["nll"] == pytest.approx(mean) and out["ppl"] == pytest.approx(math.exp(mean))
    sd = math.sqrt(sum((x - mean) ** 2 for x in values) / 4)
    assert out["nll_se"] == pytest.approx(sd / math.sqrt(5)) and out["nll_se"] > 0
