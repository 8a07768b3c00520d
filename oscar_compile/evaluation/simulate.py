"""Simulated compressed-cache attention: the whole sequence in one forward, with masks.

The compressed cache is exact to simulate without running it step by step: a token's quantized
key/value never changes once written, and what query t reads depends only on how many tokens were
cached when it ran (``starts[t]``, quantizers.cache_starts). So each layer fake-quantizes its keys
and values once per sequence and attends over two copies side by side, ``[K; K_q]`` and
``[V; V_q]``, with a boolean mask that lets query t see copy 1 of key p exactly when the cache
would hand it the quantized one (and copy 0 otherwise, causally). One softmax over the union is
the softmax of the mixed cache. KIVI, whose keys and values age out at different times, uses the
four (key copy, value copy) pairs. tests/evaluation/test_simulate.py checks this against
``apply()`` + the real cache, token for token.

The override (oscar_compile/attention_override.py, shared with calibration's capture) sees the
post-RoPE queries and keys and the values of every layer.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..architectures import attention_modules, decoder_layers
from ..attention_override import override_attention
from .quantizers import LayerQuantizer

logger = logging.getLogger(__name__)

# fn(q [B, H_q, T, D], k, v [B, H_kv, T, D], scaling, run_inner) -> [B, T, H_q, D]
LayerAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, Callable[[], torch.Tensor]], torch.Tensor]

@contextlib.contextmanager
def attention_override(model: nn.Module, per_layer: Sequence[LayerAttention]) -> Iterator[None]:
    """Within the block, layer i's attention is ``per_layer[i]`` (which may call the model's own)."""
    num_layers = len(attention_modules(model))
    if len(per_layer) != num_layers:
        raise ValueError(f"{len(per_layer)} attention functions for {num_layers} layers")

    def dispatch(layer, module, q, k, v, kwargs, run_inner):
        scaling = kwargs.get("scaling") or getattr(module, "scaling", q.shape[-1] ** -0.5)
        return per_layer[layer](q, k, v, scaling, lambda: run_inner()[0]), None

    with override_attention(model, dispatch):
        yield


def _repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, H_kv, S, D] -> [B, H_q, S, D]: query head j reads KV head j // g."""
    return x.repeat_interleave(num_heads // x.shape[1], dim=1)


def mixed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_q: torch.Tensor, v_q: torch.Tensor,
                    key_mask: torch.Tensor, value_mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention where query t reads k_q[p] where key_mask[t, p], v_q[p] where value_mask[t, p].

    q: [B, H_q, T, D]; k, v, k_q, v_q: [B, H_kv, T, D] (same dtype); masks: [B|1, T, T] bool,
    False on and above the diagonal. Returns [B, T, H_q, D].
    """
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if key_mask is value_mask:
        pairs = [(k, v, causal & ~key_mask), (k_q, v_q, key_mask)]
    else:
        pairs = [(k, v, causal & ~key_mask & ~value_mask), (k_q, v, key_mask & ~value_mask),
                 (k, v_q, ~key_mask & value_mask), (k_q, v_q, key_mask & value_mask)]
    pairs = [pair for pair in pairs if bool(pair[2].any())]
    H = q.shape[1]
    keys = _repeat_kv(torch.cat([p[0] for p in pairs], dim=2), H)  # [B, H_q, n * T, D]
    values = _repeat_kv(torch.cat([p[1] for p in pairs], dim=2), H)
    mask = torch.cat([p[2].expand(-1, T, T) for p in pairs], dim=-1)[:, None]  # [B|1, 1, T, n * T]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)


def simulated_layer(quantizer: LayerQuantizer | None, starts: torch.Tensor) -> LayerAttention:
    """The attention of one layer under ``quantizer`` for a batch whose cache schedule is ``starts`` [B|1, T]."""

    def attend(q, k, v, scaling, run_inner):
        if quantizer is None:
            return run_inner()
        T = k.shape[2]
        if T != starts.shape[-1]:
            raise ValueError(f"the schedule covers {starts.shape[-1]} positions, the forward has {T} "
                             "(no KV cache here)")
        # starts[t] <= t and every rule keeps p < starts[t]: the masks never reach past the diagonal
        key_mask, value_mask = quantizer.bounds(starts.to(q.device)).masks(T)
        if not bool(key_mask.any() | value_mask.any()):
            return run_inner()  # nothing quantized yet: exactly the model's own attention
        k_q, v_q = quantizer.fake_quantize(k, v)
        return mixed_attention(q, k, v, k_q.to(k.dtype), v_q.to(v.dtype), key_mask, value_mask, scaling)

    return attend


@contextlib.contextmanager
def capture_hidden(model: nn.Module, positions: torch.Tensor, into: list) -> Iterator[None]:
    """Append each decoder layer's output at ``positions`` ([P] long) to ``into`` as float32 [B, P, hidden]."""
    def hook(module, args, output):
        h = output[0] if isinstance(output, tuple) else output
        into.append(h[:, positions.to(h.device)].float())

    handles = [layer.register_forward_hook(hook) for layer in decoder_layers(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def simulated_logits(model: nn.Module, quantizers: Sequence[LayerQuantizer | None], input_ids: torch.Tensor,
                     starts: torch.Tensor, logits_to_keep: int = 0, label: str = "") -> torch.Tensor:
    """Logits of ``model`` with the compressed cache simulated: [B, T or logits_to_keep, vocab] float32.

    input_ids: [B, T] with no padding inside a row (right padding is harmless: nothing attends
    forward). ``logits_to_keep`` > 0 computes only the last that many positions. Non-finite logits
    (a quantizer overflowing) are logged under ``label`` and returned as they are, so one broken
    method shows up as NaN in the results instead of ending a long run.
    """
    per_layer = [simulated_layer(qz, starts) for qz in quantizers]
    kwargs = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}
    with attention_override(model, per_layer):
        logits = model(input_ids=input_ids, use_cache=False, **kwargs).logits.float()
    if not bool(torch.isfinite(logits).all()):
        logger.warning("%s: non-finite logits under the simulated cache", label or "a method")
    return logits
