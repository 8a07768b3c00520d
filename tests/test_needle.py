"""oscar_compile.data.needle: exact lengths, determinism, where the fact sits, both layouts."""
from pathlib import Path

import pytest

import oscar_compile
from oscar_compile.data.needle import TokenAdapter, make_needle_sample, needle_grid

BUNDLED = Path(oscar_compile.__file__).parent / "bundled" / "oscar-tiny-qwen3"


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(BUNDLED), local_files_only=True)


@pytest.fixture(scope="module")
def haystack(tok):
    # Real text with document separators inside, as heldout.bin holds.
    text = (Path(oscar_compile.__file__).parent / "data" / "needle.py").read_text()
    ids = tok.encode(text, add_special_tokens=False)
    return (ids + [tok.eos_token_id]) * 8


@pytest.mark.parametrize("fmt", ["plain", "chat"])
@pytest.mark.parametrize("length", [128, 300, 1024])
def test_exact_length_and_answer_position(tok, haystack, fmt, length):
    s = make_needle_sample(tok, haystack, length, depth=0.5, seed=7, fmt=fmt)
    assert len(s.input_ids) == s.length == length
    assert s.input_ids[0] == tok.bos_token_id
    assert tok.decode(s.answer_ids).strip() == s.answer and len(s.answer) == 6
    # The needle sentence sits at needle_pos and carries the very same answer ids.
    needle_text = tok.decode(s.input_ids[s.needle_pos:])
    assert needle_text.startswith(f"\nThe special magic number for {s.key} is {s.answer}.\n")
    # The prompt stops right before the value.
    assert s.prompt_text.endswith(f"The special magic number for {s.key} is")
    assert abs(s.depth - 0.5) < 0.02
    assert s.completion_ids[:len(s.answer_ids)] == s.answer_ids
    assert s.completion_ids[-1] == tok.eos_token_id


def test_deterministic_and_seed_dependent(tok, haystack):
    a = make_needle_sample(tok, haystack, 512, seed=3, n_distractors=2)
    b = make_needle_sample(tok, haystack, 512, seed=3, n_distractors=2)
    c = make_needle_sample(tok, haystack, 512, seed=4, n_distractors=2)
    assert a == b
    assert (a.key, a.answer, a.input_ids) != (c.key, c.answer, c.input_ids)


def test_depth_extremes_and_random_depth(tok, haystack):
    first = make_needle_sample(tok, haystack, 400, depth=0.0, seed=1)
    last = make_needle_sample(tok, haystack, 400, depth=1.0, seed=1)
    assert first.depth == 0.0 and first.needle_pos == 1
    assert last.depth == 1.0
    depths = {make_needle_sample(tok, haystack, 400, seed=k).depth for k in range(20)}
    assert len(depths) > 10 and all(0.0 <= d <= 1.0 for d in depths)


def test_distractors_have_other_keys_and_values(tok, haystack):
    s = make_needle_sample(tok, haystack, 600, seed=11, n_distractors=3)
    text = tok.decode(s.input_ids)
    assert text.count("The special magic number for") == 4 + 1   # 4 facts + question
    assert text.count(s.answer) == 1
    assert text.count(f"for {s.key} is") == 2                   # its fact + the answer prefix


def test_haystack_special_tokens_become_newlines(tok, haystack):
    s = make_needle_sample(tok, haystack, 1024, seed=5)
    specials = set(tok.all_special_ids)
    assert not specials & set(s.input_ids[1:])


def test_chat_layout_matches_template(tok, haystack):
    s = make_needle_sample(tok, haystack, 256, seed=2, fmt="chat")
    assert s.messages and s.messages[0]["role"] == "user"
    assert s.messages[0]["content"].endswith(f"What is the special magic number for {s.key}?")
    rendered = tok.apply_chat_template(s.messages, add_generation_prompt=True, tokenize=False)
    prompt = tok.decode(s.input_ids)
    assert prompt.startswith(rendered[:len("<|startoftext|><|im_start|>user\n")])
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\nThe special magic number for "
                           f"{s.key} is")
    assert rendered.endswith("<|im_start|>assistant\n")


def test_raw_tokenizers_object_gives_same_sample(tok, haystack):
    tokenizers = pytest.importorskip("tokenizers")
    raw = tokenizers.Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    assert make_needle_sample(raw, haystack, 300, seed=9, fmt="chat") == \
        make_needle_sample(tok, haystack, 300, seed=9, fmt="chat")


def test_grid_and_errors(tok, haystack):
    grid = list(needle_grid(tok, haystack, [200, 400], [0.0, 0.5, 1.0], 2, seed=1))
    assert len(grid) == 12
    assert [s.length for s in grid[:6]] == [200] * 6
    assert len({s.answer for s in grid}) > 6
    with pytest.raises(ValueError):
        make_needle_sample(tok, haystack, 20, seed=0)
    with pytest.raises(ValueError):
        make_needle_sample(tok, haystack, 300, seed=0, fmt="xml")
    with pytest.raises(ValueError):
        make_needle_sample(tok, haystack[:50], 300, seed=0)
    assert TokenAdapter(tok).bos == tok.bos_token_id
