"""A compact training-time implementation of the Qwen3 decoder, weight-compatible with HF.

Why not train ``transformers.Qwen3ForCausalLM`` directly: the training run gets one short
GPU lease, and a small self-contained module compiles predictably with ``torch.compile``
(fused RMSNorm/RoPE/SwiGLU, flash SDPA, loss inside the graph). Parameter names and the
math match HF's Qwen3 exactly (q/k RMSNorm per head before RoPE, rotate-half RoPE, SwiGLU,
tied embeddings), so ``to_hf`` copies the state dict 1:1 and
``tests``/``train.py --smoke`` check that the logits agree.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TinyQwen3Config:
    vocab_size: int = 8192
    hidden_size: int = 384
    intermediate_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 128
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    bos_token_id: int = 1
    eos_token_id: int = 0
    pad_token_id: int = 0

    def hf_config(self):
        from transformers import Qwen3Config

        d = asdict(self)
        return Qwen3Config(**d, tie_word_embeddings=True, hidden_act="silu", attention_bias=False,
                           use_sliding_window=False, initializer_range=0.02, use_cache=True)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def rope_tables(cfg: TinyQwen3Config, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (cfg.rope_theta
                 ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=device) / cfg.head_dim))
    pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TinyQwen3Config):
        super().__init__()
        self.cfg = cfg
        h, d, kv = cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        c = self.cfg
        q = self.q_norm(self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = cos[:t].to(q.dtype), sin[:t].to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = c.num_attention_heads // c.num_key_value_heads
        # Expanding K/V to the query heads keeps us on the flash kernel on every torch version.
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=c.head_dim ** -0.5)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TinyQwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: TinyQwen3Config):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: TinyQwen3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TinyQwen3(nn.Module):
    """Qwen3 causal LM; ``forward(ids, targets)`` returns the mean next-token loss."""

    def __init__(self, cfg: TinyQwen3Config):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-style init: N(0, 0.02), residual output projections scaled by 1/sqrt(2L)."""
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                residual_out = name.endswith(("o_proj.weight", "down_proj.weight"))
                s = std / math.sqrt(2 * self.cfg.num_hidden_layers) if residual_out else std
                nn.init.normal_(p, mean=0.0, std=s)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.model.norm(x)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.hidden(ids)
        if targets is None:
            return self.lm_head(h)
        return self.head_loss(h, targets)

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (fp32 logits); a separate method so it compiles alone."""
        logits = self.lm_head(h).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rope_")}


def to_hf(model: TinyQwen3, dtype=torch.bfloat16):
    """Return a ``transformers.Qwen3ForCausalLM`` holding this model's weights."""
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM(model.cfg.hf_config())
    missing, unexpected = hf.load_state_dict(model.hf_state_dict(), strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]  # tied to embed_tokens
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    hf.tie_weights()
    return hf.to(dtype)
