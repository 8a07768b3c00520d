"""Deterministic mode's building blocks give each row the same bits whatever rows share its call.

A row computed alone (M = 1), among 3 and among 64 rows must be bitwise equal, for the
batch-invariant linear (CPU tiles and the Triton persistent matmul) and the per-row reductions
(RMSNorm). Values are also checked against the plain-torch reference (float32 summation order:
a relative tolerance, since only the order of the same products differs).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from oscar_compile.kernels.determinism import batch_invariant_linear, deterministic, is_deterministic, split_tokens
from oscar_compile.kernels.elementwise.elementwise_ref import rms_norm_ref
from oscar_compile.kernels.matmul.matmul_ref import ROW_TILE, linear_ref, linear_tiled

# bitwise invariance of the kernel, not of the host's BLAS (tests/kernels/conftest.py)
pytestmark = pytest.mark.usefixtures("row_invariant_dot")

BATCHES = (1, 3, 64)


def _rows_invariant(fn, x: torch.Tensor) -> None:
    """fn(x[rows]) equals fn(x)[rows] bitwise for a row alone, among 3 and among all 64 (shuffled)."""
    full = fn(x)
    for m in BATCHES:
        for start in (0, x.shape[0] - m):
            assert torch.equal(fn(x[start : start + m]), full[start : start + m]), (m, start)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1)).to(x.device)
    assert torch.equal(fn(x[perm]), full[perm])


def _inputs(n: int, k: int, device, dtype=torch.float32, bias: bool = True, rows: int = 64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("n,k,bias", [(96, 384, True), (1024, 384, False), (40, 72, True)])
def test_cpu_tiled_linear_is_batch_invariant(n, k, bias):
    x, w, b = _inputs(n, k, "cpu", bias=bias)
    _rows_invariant(lambda rows: linear_tiled(rows, w, b), x)
    torch.testing.assert_close(linear_tiled(x, w, b), linear_ref(x, w, b), rtol=1e-5, atol=1e-5)


def test_cpu_plain_matmul_is_not_batch_invariant_here():
    """Why the tiles exist: the BLAS answers one row (GEMV) differently from 64 (GEMM). If this
    ever passes, the invariance test above still holds, but it no longer shows anything."""
    x, w, _ = _inputs(1024, 384, "cpu", bias=False)
    full = x @ w.T
    if all(torch.equal(x[i : i + 1] @ w.T, full[i : i + 1]) for i in range(64)):
        pytest.skip("this BLAS happens to give one row and 64 rows the same bits")
    assert ROW_TILE > 1


def test_the_mode_routes_every_linear_and_restores():
    x, w, b = _inputs(96, 384, "cpu")
    layer = nn.Linear(384, 96)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    assert not is_deterministic() and split_tokens() is None
    with deterministic():
        assert is_deterministic() and split_tokens() is not None
        with torch.no_grad():
            _rows_invariant(layer, x)
            assert torch.equal(layer(x), batch_invariant_linear(x, w, b))
        with deterministic(False):
            assert not is_deterministic()
        assert is_deterministic()
    assert not is_deterministic()


def test_rms_norm_reference_is_per_row():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 4096, generator=g)
    w = torch.randn(4096, generator=g)
    _rows_invariant(lambda rows: rms_norm_ref(rows, w, 1e-6), x)


@pytest.mark.parametrize("n,k,bias", [(96, 256, True), (64, 200, False)])
def test_triton_linear_is_batch_invariant(tdevice, n, k, bias):
    from oscar_compile.kernels.matmul.matmul_triton import linear_triton

    x, w, b = _inputs(n, k, tdevice, bias=bias)
    _rows_invariant(lambda rows: linear_triton(rows, w, b), x)
    torch.testing.assert_close(linear_triton(x, w, b), linear_ref(x, w, b), rtol=1e-4, atol=1e-4)


def test_triton_rms_norm_is_per_row(tdevice):
    from oscar_compile.kernels.elementwise.elementwise_triton import rms_norm_triton

    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=g).to(tdevice)
    w = torch.randn(256, generator=g).to(tdevice)
    _rows_invariant(lambda rows: rms_norm_triton(rows, w, 1e-6), x)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (4096, 12288), (151936, 1024)])
def test_triton_linear_bf16_rows_on_the_gpu(n, k):
    """The 8B shapes (merged QKV, O, down) and an LM head, in bfloat16 as served: 300 rows take
    the prefill tile, 1, 3 and 64 the decode tile (matmul_triton.TILES), and agree bitwise."""
    from oscar_compile.kernels.matmul.matmul_triton import linear_triton, tile_for

    x, w, _ = _inputs(n, k, "cuda", torch.bfloat16, bias=False, rows=300)
    assert tile_for(300) != tile_for(64)
    _rows_invariant(lambda rows: linear_triton(rows, w), x)
    torch.testing.assert_close(linear_triton(x, w).float(), linear_ref(x, w).float(), rtol=2e-2, atol=2e-2)


def test_reference_attention_rows_do_not_depend_on_the_chunking():
    """Deterministic mode: a query row's output is the same whether its sequence's earlier
    tokens came in its chunk or from the cache (L), and close to the plain reference."""
    from oscar_compile.kernels.attention.decode.attention_ref import _attend, _attend_invariant

    g = torch.Generator().manual_seed(4)
    S, H_q, H_kv, D = 150, 6, 2, 64
    q, k, v = (torch.randn(S, h, D, generator=g) for h in (H_q, H_kv, H_kv))
    whole = _attend_invariant(q, k, v, 0, 0.125)
    torch.testing.assert_close(whole, _attend(q, k, v, 0, 0.125), rtol=1e-5, atol=1e-5)
    for L in (1, 63, 64, 100, 149):
        assert torch.equal(_attend_invariant(q[L:], k, v, L, 0.125), whole[L:]), L
        assert torch.equal(_attend_invariant(q[L : L + 1], k[: L + 1], v[: L + 1], L, 0.125), whole[L : L + 1]), L


def test_reference_rotation_rows_are_batch_invariant():
    from oscar_compile.kernels.elementwise.rotate_ref import rotate_ref

    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 4, 64, 128, generator=g)  # [B, H, T, D]
    rot = torch.linalg.qr(torch.randn(2, 128, 128, generator=g))[0]
    mean = torch.randn(2, 128, generator=g)
    with deterministic():
        full = rotate_ref(x, rot, mean)
        for m in BATCHES:
            assert torch.equal(rotate_ref(x[:, :, -m:], rot, mean), full[:, :, -m:]), m
    torch.testing.assert_close(full, rotate_ref(x, rot, mean), rtol=1e-5, atol=1e-5)


def test_triton_rope_with_rotation_rows_are_batch_invariant(tdevice):
    """The fused RoPE + key rotation: its column split and token packing follow the token count by
    default; in deterministic mode one tiling serves every count."""
    from oscar_compile.kernels.elementwise.elementwise_triton import rope_triton

    g = torch.Generator().manual_seed(6)
    T, H_q, H_kv, D = 64, 4, 2, 128
    q = torch.randn(1, H_q, T, D, generator=g).to(tdevice)
    k = torch.randn(1, H_kv, T, D, generator=g).to(tdevice)
    cos = torch.randn(1, T, D, generator=g).to(tdevice)
    sin = torch.randn(1, T, D, generator=g).to(tdevice)
    rot = torch.linalg.qr(torch.randn(H_kv, D, D, generator=g))[0].to(tdevice)
    with deterministic():
        q_all, k_all = rope_triton(q, k, cos, sin, rot)
        for m in BATCHES:
            q_m, k_m = rope_triton(q[:, :, -m:], k[:, :, -m:], cos[:, -m:], sin[:, -m:], rot)
            assert torch.equal(q_m, q_all[:, :, -m:]) and torch.equal(k_m, k_all[:, :, -m:]), m
