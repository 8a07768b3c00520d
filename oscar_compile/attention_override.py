"""Run a function of ours in place of a model's attention, per layer, with the model's own at hand.

Every supported architecture calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
with the post-norm, post-RoPE queries and keys and the values, right where SDPA runs. So we
register one more attention implementation that dispatches to a per-layer function, which may
call the model's own implementation (``run_inner``). Calibration uses it to watch those tensors
(capture), evaluation to replace attention by a simulated compressed cache. It works wherever
the attention module lives (CPU, GPU, a device_map): the function sees each layer's tensors on
that layer's device.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .architectures import attention_modules

IMPLEMENTATION = "oscar_override"

# fn(layer, module, q [B, H_q, T, D], k, v [B, H_kv, T, D], kwargs, run_inner) -> (out [B, T, H_q, D], weights)
# run_inner() calls the model's own attention implementation on the same inputs.
LayerFunction = Callable[[int, nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, dict, Callable[[], tuple]], tuple]

_active: dict[int, tuple[int, LayerFunction, str]] = {}  # id(attention module) -> (layer, fn, inner impl)


def _eager_fallback():
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward


def _dispatch(module: nn.Module, query, key, value, attention_mask, **kwargs):
    entry = _active.get(id(module))
    if entry is None:
        raise RuntimeError(f"{IMPLEMENTATION} attention called outside override_attention()")
    layer, fn, inner_name = entry
    inner = ALL_ATTENTION_FUNCTIONS.get_interface(inner_name, _eager_fallback())
    return fn(layer, module, query, key, value, kwargs,
              lambda: inner(module, query, key, value, attention_mask, **kwargs))


AttentionInterface.register(IMPLEMENTATION, _dispatch)


def _configs_of(model: nn.Module) -> list:
    seen, configs = set(), []
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and id(cfg) not in seen:
            seen.add(id(cfg))
            configs.append(cfg)
    return configs


@contextlib.contextmanager
def override_attention(model: nn.Module, fn: LayerFunction) -> Iterator[None]:
    """Within the block, every attention call of ``model`` goes through ``fn`` (see LayerFunction)."""
    modules = attention_modules(model)
    configs = _configs_of(model)
    saved = [cfg._attn_implementation for cfg in configs]
    inner = model.config._attn_implementation or "eager"
    if inner == IMPLEMENTATION:
        raise RuntimeError("override_attention() does not nest")
    for i, m in enumerate(modules):
        _active[id(m)] = (i, fn, inner)
    try:
        for cfg in configs:
            cfg._attn_implementation = IMPLEMENTATION
        yield
    finally:
        for cfg, name in zip(configs, saved, strict=True):
            cfg._attn_implementation = name
        for m in modules:
            _active.pop(id(m), None)
