"""Decode-consistent prefill (formats/prefill.py) for the caches that run a rewritten graph.

The graph's ops attend prompt-exact: ``oscar::attention`` lets a chunk read its own tokens in
full precision. Under the decode-consistent semantics a cache runs the layer's INT-b ops itself
when the graph asks for their inputs (:func:`run_decode_consistent`): the decode-consistent
attention (``kernels/attention/prefill/attention_decode_consistent_ref.py`` states it) on the new tokens, then the
graph's own ``oscar::cache_write``, with the constants the graph's calls carry
(``cache.op_constants``). It hands the graph's ops an empty chunk (no token to attend or write)
and gives back the output it computed when the graph hands in theirs. Each step runs so, one-token
decode rows included: a decode row is the one-token case of the same rule (on the CPU computed
the same way; on CUDA by ``oscar::attention``, below), except in a captured CUDA graph of a decode
step, which runs the graph's ops (``runtime/worker/compressed_runner.py``).

The attention runs the Triton path on CUDA (:func:`triton_decode_consistent_attention`: for chunks
the kernel of ``kernels/attention/prefill/decode_consistent_paged_triton.py``, which reads the
history from the INT-b pages as stored, with a pre-pass over the band of W + T positions, so no
16-bit copy of a sequence's history is built; ``oscar::attention`` for decode rows) and the
plain-torch reference elsewhere (:func:`decode_consistent_attention`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from itertools import accumulate

import torch

from ..formats.cache import LayerFormat
from ..formats.op_args import AttentionArgs, CacheWriteArgs
from ..kernels import ops  # the oscar:: ops called below, directly (cheap: no Triton at import)
from ..kernels.attention.prefill.attention_decode_consistent_ref import attention_decode_consistent_ref
from .contract import layer_input_names


def decode_consistent_attention(device: torch.device, use_triton: bool | None = None) -> Callable:
    """The attention :func:`run_decode_consistent` calls (the reference's arguments): the Triton
    path on CUDA (:func:`triton_decode_consistent_attention`), the reference elsewhere.
    ``use_triton`` overrides the choice (True on the CPU: Triton's interpreter, with
    TRITON_INTERPRET=1)."""
    if use_triton is None:
        use_triton = torch.device(device).type == "cuda"
    return triton_decode_consistent_attention if use_triton else attention_decode_consistent_ref


# One kind of a call's rows: (decode rows?, the rows of q / k / v, their cu_seqlens; None: the call's own)
RowPart = tuple[bool, "slice | torch.Tensor", "torch.Tensor | None"]


def split_rows(counts: list[int], put: Callable[[list[int], torch.dtype], torch.Tensor]) -> list[RowPart]:
    """A call's rows by kind, from its sequences' new-token counts on the host: decode rows (one new
    token), then chunk rows. ``put`` makes a device tensor of a host list; the runner builds the
    split once per step with a copy that does not wait on the stream, so no layer reads lengths
    back from the device."""
    starts = list(accumulate(counts, initial=0))
    parts: list[RowPart] = []
    for decode in (True, False):
        keep = [n if (n == 1) == decode else 0 for n in counts]
        if not any(keep):
            continue
        if keep == counts:  # the whole call: no gather
            parts.append((decode, slice(0, starts[-1]), None))
            continue
        rows = [a + t for a, n in zip(starts[:-1], keep, strict=True) for t in range(n)]
        # one run of rows (a mixed step's decode rows, then its chunk, as the scheduler orders
        # them): a view, where a gather would launch a kernel per tensor and layer
        taken = slice(rows[0], rows[-1] + 1) if rows[-1] - rows[0] + 1 == len(rows) else put(rows, torch.int64)
        parts.append((decode, taken, put(list(accumulate(keep, initial=0)), torch.int32)))
    return parts


def triton_decode_consistent_attention(q, k, v, cu_seqlens, clip_k, clip_v, parts: list[RowPart] | None = None,
                                       step_memo: dict | None = None, **rest) -> torch.Tensor:
    """The reference's call, one kind of rows at a time (``parts``, by default split from
    ``cu_seqlens`` read back to the host): those with one new token (decode rows) through
    ``oscar::attention``, whose one-token rows are the rule's (the decode step's own kernels: a
    decode row's bits do not depend on whether a chunk shares its step), longer chunks through the
    paged prefill kernel (``step_memo``: the kernel's, one dict per step). Triton is imported on
    first use (``import oscar_compile`` stays cheap)."""
    from ..kernels.attention.prefill.decode_consistent_paged_triton import attention_decode_consistent_paged_triton

    if parts is None:
        starts = cu_seqlens.tolist()
        counts = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
        parts = split_rows(counts, lambda xs, dtype: torch.tensor(xs, dtype=dtype, device=q.device))
    out = None
    for decode, rows, cu in parts:
        args = dict(q=q[rows], k=k[rows], v=v[rows], cu_seqlens=cu_seqlens if cu is None else cu, **rest)
        if decode:
            got = ops.direct(torch.ops.oscar.attention.default)(*AttentionArgs(**args))
        else:
            got = attention_decode_consistent_paged_triton(**args, clip_k=clip_k, clip_v=clip_v, step_memo=step_memo)
        if cu is None:  # the whole call
            return got
        if out is None:  # two parts: every row is a decode row or a chunk row, each written below
            out = torch.empty_like(q) if len(parts) == 2 else torch.zeros_like(q)
        out[rows] = got
    return torch.zeros_like(q) if out is None else out


def run_decode_consistent(
    inputs: tuple, layer: LayerFormat, scale: float, clip_k: float, clip_v: float, use_triton: bool | None = None,
    parts: list[RowPart] | None = None, step_memo: dict | None = None,
) -> tuple[torch.Tensor, tuple]:
    """Attend and write the new tokens of ``inputs`` (a windowed layer's ``layer_input_names``
    tuple) decode-consistently -> (output [N, H_q, D], the inputs of an empty chunk for the graph).
    ``use_triton``: see :func:`decode_consistent_attention`; ``parts``: the Triton path's row
    split (:func:`split_rows`), when the caller has it from the host; ``step_memo``: a dict the
    caller keeps for one step, which the Triton path's every layer shares."""
    part = dict(zip(layer_input_names(layer), inputs, strict=True))
    q, k, v = part["q"], part["k"], part["v"]
    cache = {name: part[name] for name in CacheWriteArgs._fields if name in part and name not in ("k", "v")}
    window = dict(sink=layer.sink, recent=layer.recent, bits=layer.bits, group_size=layer.group_size)
    attend = decode_consistent_attention(q.device, use_triton)
    if attend is triton_decode_consistent_attention:
        attend = functools.partial(attend, parts=parts, step_memo=step_memo)
    out = attend(q=q, k=k, v=v, scale=scale, clip_k=clip_k, clip_v=clip_v, **cache, **window)
    cache["cu_seqlens"] = part["write_cu"]
    ops.direct(torch.ops.oscar.cache_write.default)(*CacheWriteArgs(k=k, v=v, clip_k=clip_k, clip_v=clip_v, **cache,
                                                                    **window))
    none = torch.zeros_like(part["cu_seqlens"])
    empty = {**part, "q": q[:0], "k": k[:0], "v": v[:0], "cu_seqlens": none, "write_cu": none}
    return out, tuple(empty.values())
