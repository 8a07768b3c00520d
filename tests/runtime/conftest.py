"""Tiny random Qwen3 plus a byte-level BPE tokenizer built on the spot: no downloads.

The weights are random, so outputs are gibberish, but every exactness test compares two paths
over the same weights. A wider init than the default spreads the logits so greedy argmax ties
(which float noise could flip) do not occur.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# the helper modules here (server_http, runtime_fakes, fuzz_bodies, tiny_models) are imported by
# the tests of core/, worker/, server/ and structured_output/ as top-level modules
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_models import build_model  # noqa: E402

from oscar_compile.testing import CHAT_TEMPLATE, SPECIALS  # noqa: F401
from oscar_compile.testing import tiny_tokenizer as build_tokenizer


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
