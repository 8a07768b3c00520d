"""Needle prompts start with the model's own BOS, or with none, for every tokenizer convention.

Three tiny byte tokenizers built in the test (no download): the bundled convention
(``<|startoftext|>``), Llama / Mistral's (``<s>``) and most Qwen tokenizers' (no BOS at all).
"""
import numpy as np
import pytest

from oscar_compile.data.needle import TokenAdapter, make_needle_sample
from oscar_compile.evaluation import evaluate
from oscar_compile.evaluation.fixtures import byte_tokenizer, write_tiny_model_dir
from oscar_compile.evaluation.needle_task import needle_cases

CONVENTIONS = {"startoftext": ("<|startoftext|>", ()), "llama": ("<s>", ("<s>",)), "none": (None, ())}


def _tokenizer(convention: str):
    bos, extra = CONVENTIONS[convention]
    return byte_tokenizer(bos=bos, extra_special=extra)


@pytest.fixture(scope="module")
def haystack():
    return np.random.default_rng(0).integers(0, 256, 6000).astype(np.int64)


@pytest.mark.parametrize("fmt", ["plain", "chat"])
@pytest.mark.parametrize("convention", list(CONVENTIONS))
def test_prompt_starts_with_the_tokenizers_bos_or_none(convention, fmt, haystack):
    tok = _tokenizer(convention)
    s = make_needle_sample(tok, haystack, 300, depth=0.5, seed=3, fmt=fmt)
    assert len(s.input_ids) == 300
    bos = tok.bos_token_id
    if bos is None:
        assert tok.bos_token is None
        assert s.input_ids[0] != tok.convert_tokens_to_ids("<|startoftext|>")
        assert s.input_ids[0] == (tok.convert_tokens_to_ids("<|im_start|>") if fmt == "chat" else s.input_ids[0])
        assert s.prompt_text == tok.decode(s.input_ids)  # nothing stripped in front
    else:
        assert s.input_ids[0] == bos and bos not in s.input_ids[1:]
        assert s.prompt_text == tok.decode(s.input_ids[1:])
    assert tok.decode(s.input_ids[s.needle_pos:]).startswith(f"\nThe special magic number for {s.key} is {s.answer}.")
    assert s.completion_ids[-1] == tok.eos_token_id


def test_llama_bos_is_not_looked_up_by_name(haystack):
    tok = _tokenizer("llama")
    assert TokenAdapter(tok).bos == tok.convert_tokens_to_ids("<s>") != tok.convert_tokens_to_ids("<|startoftext|>")
    assert TokenAdapter(tok, bos_id=None).bos is None  # an explicit id (the model's) wins
    cases = needle_cases(tok, haystack, [200], [0.5], per_cell=2, bos=None)
    assert len(cases) == 2 and all(c.sample.input_ids[0] != tok.bos_token_id for c in cases)


@pytest.mark.parametrize("convention", list(CONVENTIONS))
def test_eval_runs_the_needle_task_with_the_models_bos(convention, tmp_path, monkeypatch):
    tok = _tokenizer(convention)
    model_dir = write_tiny_model_dir(tmp_path / "model", num_layers=1, heldout_tokens=2048, calib_tokens=1024,
                                     tokenizer=tok)
    seen = []
    import oscar_compile.evaluation.runner as runner

    def spy(*args, **kwargs):
        cases = needle_cases(*args, **kwargs)
        seen.extend(cases)
        return cases

    monkeypatch.setattr(runner, "needle_cases", spy)
    res = evaluate(model=str(model_dir), specs=["bf16"], contexts=[256], tasks=["needle"], needle_per_cell=1,
                   needle_depths=[0.0, 1.0], num_samples=1)
    assert "skipped" not in res["needle"] and res["needle"]["by_length"]["bf16"]["256"] >= 0.0
    assert len(seen) == 2
    for c in seen:
        if tok.bos_token_id is None:
            assert c.sample.input_ids[0] < 256  # a haystack byte, not a special token
        else:
            assert c.sample.input_ids[0] == tok.bos_token_id
