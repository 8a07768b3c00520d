"""See what attention actually consumes, without changing what the model computes.

Every supported architecture calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` with
the post-norm, post-RoPE queries and keys and the values, right where SDPA runs. So capture
registers one more attention implementation that hands those tensors (and the attention output)
to a callback, then runs the model's own implementation unchanged. It works wherever the
attention module lives (CPU, GPU, a device_map), since the callback sees each layer's tensors on
that layer's device.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..architectures import attention_modules

CAPTURE_IMPLEMENTATION = "oscar_capture"

# q: [B, H_q, T, D]; k, v: [B, H_kv, T, D]; out: [B, T, H_q, D]
CaptureCallback = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

_active: dict[int, tuple[int, CaptureCallback, str]] = {}  # id(attention module) -> (layer, callback, inner impl)


def _eager_fallback():
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward


def _capturing_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    entry = _active.get(id(module))
    if entry is None:
        raise RuntimeError("oscar_capture attention called outside capture_attention()")
    layer, callback, inner_name = entry
    inner = ALL_ATTENTION_FUNCTIONS.get_interface(inner_name, _eager_fallback())
    out, weights = inner(module, query, key, value, attention_mask, **kwargs)
    callback(layer, query, key, value, out)
    return out, weights


AttentionInterface.register(CAPTURE_IMPLEMENTATION, _capturing_attention)


def _configs_of(model: nn.Module) -> list:
    seen, configs = set(), []
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and id(cfg) not in seen:
            seen.add(id(cfg))
            configs.append(cfg)
    return configs


@contextlib.contextmanager
def capture_attention(model: nn.Module, callback: CaptureCallback) -> Iterator[None]:
    """Within the block, every forward of ``model`` calls ``callback(layer, q, k, v, out)`` per layer."""
    modules = attention_modules(model)
    configs = _configs_of(model)
    saved = [cfg._attn_implementation for cfg in configs]
    inner = model.config._attn_implementation or "eager"
    for i, m in enumerate(modules):
        _active[id(m)] = (i, callback, inner)
    try:
        for cfg in configs:
            cfg._attn_implementation = CAPTURE_IMPLEMENTATION
        yield
    finally:
        for cfg, name in zip(configs, saved):
            cfg._attn_implementation = name
        for m in modules:
            _active.pop(id(m), None)
