"""The shipped oscar-tiny-qwen3 folder: shape, size limits, offline loading, and that it still
predicts held-out text as well as its model card says (CPU, a few seconds)."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import oscar_compile
from oscar_compile.data.needle import make_needle_sample

BUNDLED = Path(oscar_compile.__file__).parent / "bundled" / "oscar-tiny-qwen3"
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(str(BUNDLED), local_files_only=True, use_kernels=False)


@pytest.fixture(scope="module")
def model():
    m = transformers.AutoModelForCausalLM.from_pretrained(str(BUNDLED), local_files_only=True, use_kernels=False)
    return m.float().eval()


@pytest.fixture(scope="module")
def card():
    return json.loads((BUNDLED / "eval.json").read_text())


def test_config_is_qwen3_gqa_4k():
    cfg = json.loads((BUNDLED / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["head_dim"] == 128
    assert cfg["num_attention_heads"] // cfg["num_key_value_heads"] >= 2
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["max_position_embeddings"] >= 4096


def test_files_and_size_limits():
    shards = sorted(BUNDLED.glob("model-*.safetensors"))
    index = json.loads((BUNDLED / "model.safetensors.index.json").read_text())
    assert {p.name for p in shards} == set(index["weight_map"].values())
    assert all(p.stat().st_size <= 15_000_000 for p in shards)
    assert sum(p.stat().st_size for p in shards) <= 40_000_000
    assert sum(p.stat().st_size for p in BUNDLED.iterdir()) <= 45_000_000
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "README.md", "heldout.bin", "calib.bin"):
        assert (BUNDLED / name).is_file(), name


def test_token_files(tok):
    for name, lo in (("heldout.bin", 1_000_000), ("calib.bin", 200_000)):
        ids = np.fromfile(BUNDLED / name, dtype=np.uint16)
        assert ids.size >= lo
        assert int(ids.max()) < len(tok)
        assert (ids == tok.eos_token_id).any()           # documents are separated
        assert not (ids == tok.bos_token_id).any()       # BOS is added per window, not stored


def test_loaded_model_matches_config(model):
    c = model.config
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert c.head_dim == 128 and c.num_attention_heads // c.num_key_value_heads >= 2
    assert sum(p.numel() for p in model.parameters()) < 20_000_000


def test_heldout_perplexity_matches_card(model, tok, card):
    """Recompute the card's 'test slice' (4 windows of BOS + 511 held-out tokens)."""
    ids = np.fromfile(BUNDLED / "heldout.bin", dtype=np.uint16)
    ref = card["test_slice"]
    n = ref["ctx"] - 1
    rows = [np.concatenate([[tok.bos_token_id], ids[j * n:(j + 1) * n]]) for j in range(ref["windows"])]
    x = torch.from_numpy(np.stack(rows).astype(np.int64))
    with torch.no_grad():
        logits = model(x[:, :-1]).logits
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1)).item()
    ppl = math.exp(nll)
    assert ppl < 10.0                        # an untrained 8192-way model sits near 8192
    assert abs(ppl - ref["ppl"]) / ref["ppl"] < 0.05, (ppl, ref["ppl"])
    assert card["ppl"]["ctx"] >= 4096 and card["ppl"]["ppl"] < ppl * 1.2


def test_retrieves_a_needle(model, tok):
    haystack = np.fromfile(BUNDLED / "heldout.bin", dtype=np.uint16)
    good = 0
    for k, depth in enumerate((0.1, 0.5, 0.9)):
        s = make_needle_sample(tok, haystack, 384, depth=depth, seed=k, with_text=False)
        x = torch.tensor([s.input_ids + s.answer_ids[:-1]])
        with torch.no_grad():
            pred = model(x).logits[0, s.length - 1:].argmax(-1).tolist()
        good += pred == s.answer_ids
    assert good >= 2


@pytest.mark.parametrize("text", [
    "def f(x):\n    return {'a': x ** 2}  # comment\n",
    "Unicode: héllo wörld — 日本語 🚀\ttab\r\nend",
    "    \n\n   trailing spaces   ",
    "numbers 1234567 3.14159 0xFF",
])
def test_tokenizer_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    out = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert out == ("<|startoftext|><|im_start|>system\ns<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                   "<|im_start|>assistant\n")
    gen = json.loads((BUNDLED / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen["eos_token_id"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_chat_template_renders_tools_and_tool_turns_in_the_hermes_format(tok):
    """What the hermes tool parser reads back: the schema in a <tools> block of the system turn,
    an assistant call as <tool_call> JSON (arguments given as a dict or as OpenAI's JSON string),
    consecutive tool results in one user turn of <tool_response> blocks."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                call, {**call, "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    out = tok.apply_chat_template(msgs, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    system, rest = out.split("<|im_end|>\n", 1)
    assert system.startswith("<|startoftext|><|im_start|>system\ns\n\n# Tools\n")
    block = system.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert json.loads(block) == WEATHER
    assert rest == ('<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n'
                    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
                    '<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n'
                    '<tool_response>\nrain\n</tool_response><|im_end|>\n<|im_start|>assistant\n')
    # without tools the template is the plain ChatML one, and a system message stays its own turn
    assert tok.apply_chat_template(msgs[:2], tools=None, tokenize=False) == (
        "<|startoftext|><|im_start|>system\ns<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")
