"""The masked INT2 code layout that attention_gluon_int8 reads, from and to the planar rows (plain torch).

A 16-token page of one KV head is 512 bytes, as in the planar pools ([N_q, H_kv, 16, 32] uint8);
only the byte order inside the page differs (docs/cache-format.md):

- keys: byte ``128 q + 32 t + 8 s + 4 hh + b`` holds channel ``32 s + 16 hh + 4 t + b`` of tokens
  ``4 q + j`` in bit pair j (4 consecutive tokens of a page per byte: a one-token write ORs);
- values: byte ``16 (8 w + g) + 4 s + b`` holds token ``4 s + b``, channels
  ``16 w + g + 8 (j & 1) + 64 (j >> 1)`` in bit pair j (a token owns whole bytes);
- bit pair 3 holds (c + 2) mod 4 (read as a signed byte, the masked value is 64 (c - 2)).

The same byte order as the reference pack of the format change (kernels/code_layout_ref, issue
#32); this module converts whole pools for the kernel's tests and benchmark rows, where the
cache is written in the planar layout. Every function works on any device.
"""
from __future__ import annotations

import torch

from oscar_compile import quant


def _top_fix(c: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return torch.where(j == 3, (c + 2) % 4, c)  # (c + 2) mod 4 is its own inverse


def pack_keys(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., 16 tokens, 128 channels] (0..3) -> [..., 512] uint8 in the masked key order."""
    lead, n = codes.shape[:-2], codes.dim() - 2
    c = codes.to(torch.int32).reshape(*lead, 4, 4, 4, 2, 4, 4)  # q j | s hh t b
    j = torch.arange(4, device=codes.device).view(4, 1, 1, 1, 1)
    byte = (_top_fix(c, j) << (2 * j)).sum(dim=-5)  # [..., q, s, hh, t, b]
    byte = byte.permute(*range(n), n, n + 3, n + 1, n + 2, n + 4)  # q t s hh b
    return byte.reshape(*lead, 512).to(torch.uint8)


def unpack_keys(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_keys`."""
    lead, n = packed.shape[:-1], packed.dim() - 1
    b = packed.to(torch.int32).reshape(*lead, 4, 4, 4, 2, 4)  # q t s hh b
    j = torch.arange(4, device=packed.device).view(4, 1, 1, 1, 1, 1)
    c = _top_fix((b.unsqueeze(-6) >> (2 * j)) & 3, j)  # [..., j, q, t, s, hh, b]
    c = c.permute(*range(n), n + 1, n, n + 3, n + 4, n + 2, n + 5)  # q j s hh t b
    return c.reshape(*lead, 16, 128).to(torch.uint8)


def _value_j(device) -> torch.Tensor:
    """Bit pair j of the value dims [j1, w, j0, g]: j = j0 + 2 j1."""
    return (2 * torch.arange(2, device=device).view(2, 1, 1, 1) + torch.arange(2, device=device).view(1, 1, 2, 1))


def pack_values(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., 16 tokens, 128 channels] (0..3) -> [..., 512] uint8 in the masked value order."""
    lead, n = codes.shape[:-2], codes.dim() - 2
    c = codes.to(torch.int32).reshape(*lead, 4, 4, 2, 4, 2, 8)  # s b | j1 w j0 g
    j = _value_j(codes.device)
    byte = (_top_fix(c, j) << (2 * j)).sum(dim=(-4, -2))  # [..., s, b, w, g]
    byte = byte.permute(*range(n), n + 2, n + 3, n, n + 1)  # w g s b
    return byte.reshape(*lead, 512).to(torch.uint8)


def unpack_values(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_values`."""
    lead, n = packed.shape[:-1], packed.dim() - 1
    b = packed.to(torch.int32).reshape(*lead, 4, 8, 4, 4)  # w g s b
    b = b.permute(*range(n), n + 2, n + 3, n, n + 1)  # s b w g
    j = _value_j(packed.device)  # [j1, w, j0, g]
    c = _top_fix((b.view(*lead, 4, 4, 1, 4, 1, 8) >> (2 * j)) & 3, j)  # s b j1 w j0 g
    return c.reshape(*lead, 16, 128).to(torch.uint8)


CHUNK_PAGES = 4096  # pages converted at a time (the int32 intermediates are 64x a page's bytes)


def masked_codes(planar: torch.Tensor, keys: bool) -> torch.Tensor:
    """Planar INT2 code pages [N_q, H_kv, 16, 32] -> the same pages in the masked layout."""
    pack = pack_keys if keys else pack_values
    out = torch.empty_like(planar)
    for a in range(0, planar.shape[0], CHUNK_PAGES):
        part = planar[a:a + CHUNK_PAGES]
        out[a:a + CHUNK_PAGES] = pack(quant.unpack_codes(part, 2)).view(part.shape)
    return out


def planar_codes(masked: torch.Tensor, keys: bool) -> torch.Tensor:
    """Inverse of :func:`masked_codes`."""
    unpack = unpack_keys if keys else unpack_values
    out = torch.empty_like(masked)
    for a in range(0, masked.shape[0], CHUNK_PAGES):
        part = masked[a:a + CHUNK_PAGES]
        out[a:a + CHUNK_PAGES] = quant.pack_codes(unpack(part.reshape(*part.shape[:2], 512)), 2).view(part.shape)
    return out


def masked_pools(pools):
    """A ``CachePools`` whose code pools are copies in the masked layout (the rest shared)."""
    return pools._replace(k_codes=masked_codes(pools.k_codes, True), v_codes=masked_codes(pools.v_codes, False))


def planar_pools(pools):
    """Inverse of :func:`masked_pools`."""
    return pools._replace(k_codes=planar_codes(pools.k_codes, True), v_codes=planar_codes(pools.v_codes, False))
