"""The tiny random Qwen3 of the runtime tests (the ``tiny_model`` fixture), importable by a test
that needs a second copy of the same weights."""

from __future__ import annotations

import torch


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
