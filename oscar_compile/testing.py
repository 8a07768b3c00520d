"""Tiny random models for tests and demos, built from transformers config objects (no download)."""
from __future__ import annotations

import torch
import transformers

_CONFIGS = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
}
ARCHITECTURE_NAMES = tuple(_CONFIGS)


def tiny_model(
    arch: str = "qwen3",
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    vocab_size: int = 128,
    attention_bias: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> transformers.PreTrainedModel:
    """A randomly initialised causal LM of the given family, in eval mode, SDPA attention."""
    config_cls, model_cls = _CONFIGS[arch]
    hidden = num_heads * head_dim
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    if arch in ("qwen3", "llama"):
        kwargs["attention_bias"] = attention_bias
    config = config_cls(**kwargs)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    return model
