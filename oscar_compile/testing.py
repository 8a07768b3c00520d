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

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache stores keys and values in fixed-size pages.",
    "Continuous batching lets new requests join between decoding steps.",
    "Quantized history pages hold two-bit codes with a scale and a zero point.",
    "hello world, héllo wörld, 你好, 🙂",
] * 4


def tiny_tokenizer():
    """A byte-level BPE tokenizer (400 tokens, a chat template) trained on the spot: no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


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
