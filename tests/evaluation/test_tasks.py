"""Perplexity, agreement and the needle schedule on a tiny model."""
import math

import torch
import torch.nn.functional as F

from oscar_compile.evaluation.fixtures import byte_tokenizer
from oscar_compile.evaluation.kivi import KiviConfig, KiviQuantizer
from oscar_compile.evaluation.needle_task import _batch, needle_accuracy, needle_cases
from oscar_compile.evaluation.tasks import agreement, perplexity
from oscar_compile.formats.prefill import PROMPT_EXACT
from oscar_compile.testing import tiny_model

D = 32


def _model(vocab=64):
    return tiny_model("qwen3", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=D, vocab_size=vocab, seed=1)


def _methods():
    return {"bf16": [None, None], "kivi": [KiviQuantizer(KiviConfig(group_size=8, residual=16), D)] * 2}


def test_bf16_perplexity_is_the_models_own():
    model = _model()
    windows = torch.randint(0, 64, (3, 80), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        res = perplexity(model, _methods(), windows, ppl_tokens=24, batch_size=2)
        logits = model(windows).logits[:, 80 - 25 : -1]
    nll = F.cross_entropy(logits.reshape(-1, 64), windows[:, 56:].reshape(-1))
    assert math.isclose(res["bf16"]["ppl"], math.exp(float(nll)), rel_tol=1e-5)
    assert res["bf16"]["tokens"] == 72 and res["kivi"]["ppl"] != res["bf16"]["ppl"]


def test_agreement_of_bf16_with_itself_is_one():
    windows = torch.randint(0, 64, (2, 72), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        res = agreement(_model(), _methods(), windows, gen_tokens=16, batch_size=2)
    assert res["bf16"]["agreement"] == 1.0 and res["bf16"]["prefix"] == 1.0
    assert 0.0 <= res["kivi"]["prefix"] <= res["kivi"]["agreement"] <= 1.0


def test_needle_context_mode_caches_the_haystack_then_runs_the_question_as_one_chunk():
    tok = byte_tokenizer()
    haystack = torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(2)).numpy()
    cases = needle_cases(tok, haystack, [200, 120], [0.0, 1.0], per_cell=1)
    assert {c.sample.length for c in cases} == {200}  # 120 is too short for the layout: skipped
    ids, starts = _batch(cases, "context", pad=0, device="cpu", semantics=PROMPT_EXACT)
    c = cases[0]
    hay = c.sample.length - c.question_len
    assert ids[0, : c.sample.length].tolist() == c.sample.input_ids
    assert (starts[0, :hay] == 0).all() and (starts[0, hay : c.sample.length] == hay).all()
    assert starts[0, c.sample.length] == c.sample.length  # answer tokens: decode steps
    _, prompt_starts = _batch(cases, "prompt", pad=0, device="cpu", semantics=PROMPT_EXACT)
    assert (prompt_starts[0, : c.sample.length] == 0).all()
    for mode in ("context", "prompt"):  # the default, decode-consistent: every position reads as a decode step
        _, default_starts = _batch(cases, mode, pad=0, device="cpu")
        assert (default_starts[0] == torch.arange(default_starts.shape[1])).all()
    with torch.inference_mode():
        cells = needle_accuracy(_model(len(tok)), {"bf16": [None, None]}, cases, batch_size=2)
    assert [(x["length"], x["depth"], x["total"]) for x in cells["bf16"]] == [(200, 0.0, 1), (200, 1.0, 1)]
