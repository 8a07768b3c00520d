"""Apply a grammar's token bitmask to the logits on the device: refused tokens get -inf.

The bitmask (runtime/structured_output/backend.py) is int32 ``[B, W]``, ``W = ceil(V / 32)``:
token ``v`` of row ``b`` is allowed iff bit ``v % 32`` of ``bitmask[b, v // 32]`` is set. Bits
are read with an arithmetic right shift of the int32 word and ``& 1``, so the sign bit (bit 31)
reads as 1 like any other; the padding bits past ``V`` in the last word are ignored. A row of all
``-1`` allows every token. ``torch_apply_token_bitmask`` is the reference: one token at a time,
in plain Python ints.
"""

from __future__ import annotations

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A new tensor: ``logits`` with the tokens its bitmask row refuses set to -inf. Never changes
    ``logits`` in place (it may be a CUDA graph's output buffer)."""
    # logits: [B, V] float; bitmask: [B, W] int32 on the same device, W >= ceil(V / 32)
    B, V = logits.shape
    shifts = _SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _SHIFTS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask[:, :, None] >> shifts).bitwise_and_(1)  # [B, W, 32] int32
    allowed = bits.reshape(B, -1)[:, :V].bool()  # [B, V]
    return logits.masked_fill(~allowed, float("-inf"))


def torch_apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The reference: for every (row, token), read the bit from the word as an unsigned 32-bit int."""
    out = logits.clone()
    words = bitmask.cpu().tolist()
    for b in range(logits.shape[0]):
        for v in range(logits.shape[1]):
            if not ((words[b][v // 32] & 0xFFFF_FFFF) >> (v % 32)) & 1:
                out[b, v] = float("-inf")
    return out
