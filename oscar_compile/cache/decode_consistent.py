"""Decode-consistent prefill (formats/prefill.py) for the caches that run a rewritten graph.

The graph's ops attend prompt-exact: ``oscar::attention`` lets a chunk read its own tokens in
full precision. Under the decode-consistent semantics a cache runs the layer's INT-b ops itself
when the graph asks for their inputs (:func:`run_decode_consistent`): the decode-consistent
attention reference (``kernels/attention_decode_consistent_ref.py``) on the new tokens, then the
graph's own ``oscar::cache_write``, with the constants the graph's calls carry
(``cache.op_constants``). It hands the graph's ops an empty chunk (no token to attend or write)
and gives back the output it computed when the graph hands in theirs. Each step runs so, one-token
decode rows included: a decode row is the one-token case of the same rule, computed the same way.

The plain-torch reference only: on a GPU the option is refused (the Triton / Gluon kernels do not
implement the per-row read yet).
"""

from __future__ import annotations

import torch

from ..formats.cache import LayerFormat
from ..formats.op_args import CacheWriteArgs
from ..kernels.attention_decode_consistent_ref import attention_decode_consistent_ref
from .contract import layer_input_names

GPU_REFUSAL = (
    "decode-consistent prefill runs on the plain-torch reference (CPU) only: the GPU attention kernels "
    "do not implement its per-row read yet; use --prefill-semantics prompt-exact on a GPU"
)


def check_device(device: torch.device) -> None:
    """NotImplementedError on any device but the CPU (module docstring)."""
    if torch.device(device).type != "cpu":
        raise NotImplementedError(GPU_REFUSAL)


def run_decode_consistent(
    inputs: tuple, layer: LayerFormat, scale: float, clip_k: float, clip_v: float
) -> tuple[torch.Tensor, tuple]:
    """Attend and write the new tokens of ``inputs`` (a windowed layer's ``layer_input_names``
    tuple) decode-consistently -> (output [N, H_q, D], the inputs of an empty chunk for the graph)."""
    part = dict(zip(layer_input_names(layer), inputs, strict=True))
    q, k, v = part["q"], part["k"], part["v"]
    check_device(q.device)
    cache = {name: part[name] for name in CacheWriteArgs._fields if name in part and name not in ("k", "v")}
    window = dict(sink=layer.sink, recent=layer.recent, bits=layer.bits, group_size=layer.group_size)
    out = attention_decode_consistent_ref(q=q, k=k, v=v, scale=scale, clip_k=clip_k, clip_v=clip_v, **cache, **window)
    cache["cu_seqlens"] = part["write_cu"]
    torch.ops.oscar.cache_write(*CacheWriteArgs(k=k, v=v, clip_k=clip_k, clip_v=clip_v, **cache, **window))
    none = torch.zeros_like(part["cu_seqlens"])
    empty = {**part, "q": q[:0], "k": k[:0], "v": v[:0], "cu_seqlens": none, "write_cu": none}
    return out, tuple(empty.values())
