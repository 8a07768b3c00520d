"""See what attention actually consumes, without changing what the model computes.

The model's own attention runs unchanged; the callback gets the post-norm, post-RoPE queries and
keys, the values and the attention output of every layer (see attention_override.py).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..attention_override import override_attention

# q: [B, H_q, T, D]; k, v: [B, H_kv, T, D]; out: [B, T, H_q, D]
CaptureCallback = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@contextlib.contextmanager
def capture_attention(model: nn.Module, callback: CaptureCallback) -> Iterator[None]:
    """Within the block, every forward of ``model`` calls ``callback(layer, q, k, v, out)`` per layer."""

    def watch(layer, module, q, k, v, kwargs, run_inner):
        out, weights = run_inner()
        callback(layer, q, k, v, out)
        return out, weights

    with override_attention(model, watch):
        yield
