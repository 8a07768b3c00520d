"""Tiny random Qwen3 plus a byte-level BPE tokenizer built on the spot: no downloads.

The weights are random, so outputs are gibberish, but every exactness test compares two paths
over the same weights. A wider init than the default spreads the logits so greedy argmax ties
(which float noise could flip) do not occur.
"""

from __future__ import annotations

import pytest
import torch

from oscar_compile.testing import CHAT_TEMPLATE, SPECIALS  # noqa: F401
from oscar_compile.testing import tiny_tokenizer as build_tokenizer


def build_model(vocab_size: int, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=512, initializer_range=0.3,
                         tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).eval()
    model.generation_config.eos_token_id = 0  # "<|endoftext|>" is the first special token
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny matmuls gain nothing from threads, and on a busy 2-core CI box extra threads
    contend: one thread makes these tests ~100x faster. Restored after each module."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    return build_model(len(tokenizer))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, tiny_model, tokenizer):
    path = tmp_path_factory.mktemp("tiny-qwen3")
    tiny_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
