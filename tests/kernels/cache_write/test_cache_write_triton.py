"""Triton cache write against the reference: pools equal bitwise (codes, scales, zeros, windows).

The reference always runs on the CPU: that is the oracle. (On CUDA, torch computes
``(max - min) / qmax`` with a Python-number divisor as a multiplication by the float32
reciprocal, which can differ by one ulp from the IEEE division that the CPU and the kernel do.)
Under TRITON_INTERPRET=1 the kernel runs on the CPU too; shapes are kept small for that.
"""
from __future__ import annotations

import pytest
import torch

from oscar_compile.formats.op_args import CacheWriteArgs
from oscar_compile.kernels.cache_write.cache_write_ref import cache_write_ref
from oscar_compile.kernels.elementwise.rotate_ref import rotate_ref
from oscar_compile.kernels.testing import build_case, random_kv, with_standard_history_lens

CASES = [  # sink, recent, bits, scale dtype, head_dim, group
    (16, 32, 2, torch.float16, 64, 64),
    (0, 0, 2, torch.bfloat16, 64, 32),
    (16, 0, 4, torch.float32, 64, 32),
    (0, 16, 2, torch.float16, 128, 128),
    # a layer kept at 16 bits: rows copied as they are (a chunk of 1 demotes from lengths > 32)
    (16, 16, 16, torch.float16, 64, 64),
]


@pytest.mark.parametrize("sink,recent,bits,sdt,D,G", CASES)
@pytest.mark.parametrize("chunk", [None, 1])
def test_triton_write_matches_reference(tdevice, sink, recent, bits, sdt, D, G, chunk):
    from oscar_compile.kernels.cache_write.cache_write_triton import cache_write_triton

    lens = [0, 3, 16, 50, 81] if chunk is None else [0, 3, 40]
    kw = dict(num_kv_heads=2, head_dim=D, page_size=16, sink=sink, recent=recent, bits=bits,
              group_size=G, scale_dtype=sdt, seed=11, chunk=chunk)
    want = build_case(lens, write=cache_write_ref, **kw)
    got = build_case(lens, write=cache_write_triton, device=tdevice, **kw)
    for a, b, name in zip(got.pools, want.pools, got.pools._fields, strict=True):
        assert torch.equal(a.cpu(), b), name


@pytest.mark.parametrize("window_dtype", [torch.float16, torch.float32])
def test_triton_write_other_window_dtypes(tdevice, window_dtype):
    """The clip's bisection skips the zero low bits of the window dtype (13 for float16, none
    for float32): bitwise the reference for those windows too."""
    from oscar_compile.kernels.cache_write.cache_write_triton import cache_write_triton

    kw = dict(num_kv_heads=2, head_dim=64, page_size=16, sink=16, recent=32, bits=2, group_size=64,
              window_dtype=window_dtype, seed=13, chunk=None)
    want = build_case([3, 50, 81], write=cache_write_ref, **kw)
    got = build_case([3, 50, 81], write=cache_write_triton, device=tdevice, **kw)
    for a, b, name in zip(got.pools, want.pools, got.pools._fields, strict=True):
        assert torch.equal(a.cpu(), b), name


def test_triton_write_after_prefix_hits_matches_reference(tdevice):
    """Rings refilling after prefix-cache hits past the sink (history_lens > standard), next to a
    standard sequence: same pools bitwise (stale ring slots are never demoted)."""
    from oscar_compile.kernels.cache_write.cache_write_triton import cache_write_triton

    # (hit, L), S0 = 8, W = 16, P = 8: standard; empty ring; a ring of 12 wrapping past the
    # ring's end; a ring of 7; 26 > W tokens written after the hit in one call
    hits, lens = [0, 32, 32, 24, 24], [40, 32, 44, 31, 50]
    kw = dict(num_kv_heads=1, head_dim=64, page_size=8, sink=8, recent=16, group_size=32,
              seed=13, hits=hits, extra_tokens=20)
    want = build_case(lens, write=cache_write_ref, **kw)
    got = build_case(lens, write=cache_write_triton, device=tdevice, **kw)
    gen = torch.Generator().manual_seed(14)
    # the built state, then decode, then chunks (the last as many tokens as sequences, not one each)
    for chunk_lens in ([], [1] * 5, [3, 17, 1, 9, 0], [0, 2, 1, 1, 1]):
        if chunk_lens:
            cu = torch.tensor([0] + chunk_lens).cumsum(0).to(torch.int32)
            k, v = random_kv(sum(chunk_lens), 1, 64, gen), random_kv(sum(chunk_lens), 1, 64, gen)
            for case, write, dev in ((want, cache_write_ref, "cpu"), (got, cache_write_triton, tdevice)):
                write(k.to(dev), v.to(dev), cu.to(dev), case.cache_lens, case.window_table,
                      case.quant_table, *case.pools, 8, 16, 2, 32, 0.96, 0.92,
                      history_lens=case.history_lens)
                case.append(k.to(dev), v.to(dev), cu.to(dev))
        for a, b, name in zip(got.pools, want.pools, got.pools._fields, strict=True):
            assert torch.equal(a.cpu(), b), name


@pytest.mark.parametrize("sink,recent", [(16, 16), (0, 0)])
def test_triton_write_standard_history_lens_change_nothing(tdevice, sink, recent):
    from oscar_compile.kernels.cache_write.cache_write_triton import cache_write_triton

    kw = dict(num_kv_heads=1, head_dim=64, page_size=16, sink=sink, recent=recent, group_size=64,
              seed=14, chunk=9, device=tdevice)
    want = build_case([5, 45], write=cache_write_triton, **kw)
    got = build_case([5, 45], write=with_standard_history_lens(cache_write_triton), **kw)
    for a, b, name in zip(got.pools, want.pools, got.pools._fields, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("block_t", [1, 4, 16])
def test_triton_write_no_clip_and_chunked_prefill(tdevice, block_t):
    from functools import partial

    from oscar_compile.kernels.cache_write.cache_write_triton import cache_write_triton

    kw = dict(num_kv_heads=1, head_dim=64, page_size=16, sink=16, recent=16, bits=2,
              group_size=64, clip_k=1.0, clip_v=0.5, seed=12, chunk=37)
    want = build_case([100, 70], write=cache_write_ref, **kw)
    got = build_case([100, 70], write=partial(cache_write_triton, block_t=block_t),
                     device=tdevice, **kw)
    for a, b in zip(got.pools, want.pools, strict=True):
        assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("rot_heads", [1, 2], ids=["per_layer", "per_head"])
@pytest.mark.parametrize("fused", [False, True])
def test_triton_write_with_rotation(tdevice, fused, rot_heads):
    """With rot_k the op rotates the keys first: by the torch reference (default), bitwise what
    rotate-then-write gives; or inside the kernel (``fuse_rotation``), equal up to the float32
    summation order of the rotation.

    The fused kernel's float32 dot sums in another order than torch's matmul; a rotated value can
    then round to the neighbouring bf16 number, and a code can move by one step. Checked there:
    the value pools bitwise, key windows within one bf16 ulp (atol for values within 1e-5 of
    zero, where a relative bound says nothing), dequantized key history within one quantization
    step (+1 % and 1e-3 for the scale and zero, recomputed from a min / max that may itself have
    moved by an ulp).
    """
    from oscar_compile import quant
    from oscar_compile.kernels.cache_write.cache_write_triton import cache_write_triton

    gen = torch.Generator().manual_seed(5)
    H, D = 2, 64
    rot = torch.linalg.qr(torch.randn(rot_heads, D, D, generator=gen, dtype=torch.float64))[0].float()
    mean = torch.randn(rot_heads, D, generator=gen)
    kw = dict(num_kv_heads=H, head_dim=D, page_size=16, sink=16, recent=16, group_size=64,
              device=tdevice)
    a = build_case([0], extra_tokens=60, **kw)
    k, v = random_kv(60, H, D, gen, device=tdevice), random_kv(60, H, D, gen, device=tdevice)
    cu = torch.tensor([0, 60], dtype=torch.int32, device=tdevice)
    tail = (16, 16, 2, 64, 0.96, 0.92)
    rot, mean = rot.to(tdevice), mean.to(tdevice)
    cache_write_triton(k, v, cu, a.cache_lens, a.window_table, a.quant_table, *a.pools, *tail,
                       rot_k=rot, mean_k=mean, fuse_rotation=fused)
    rk = rotate_ref(k.transpose(0, 1)[None], rot, mean)[0].transpose(0, 1)
    b = build_case([0], extra_tokens=60, **{**kw, "device": "cpu"})
    cache_write_ref(rk.cpu(), v.cpu(), cu.cpu(), b.cache_lens, b.window_table, b.quant_table,
                    *b.pools, *tail)
    a.pools = type(a.pools)(*(x.cpu() for x in a.pools))
    if not fused:
        assert all(torch.equal(x, y) for x, y in zip(a.pools, b.pools, strict=True))
        return
    for name in ("v_win", "v_codes", "v_scale", "v_zero"):
        assert torch.equal(getattr(a.pools, name), getattr(b.pools, name)), name
    torch.testing.assert_close(a.pools.k_win.float(), b.pools.k_win.float(), rtol=2 ** -7, atol=1e-5)
    da = quant.dequantize(a.pools.k_codes, a.pools.k_scale, a.pools.k_zero, 2, 64)
    db = quant.dequantize(b.pools.k_codes, b.pools.k_scale, b.pools.k_zero, 2, 64)
    step = b.pools.k_scale.float().repeat_interleave(64, dim=-1)
    assert bool(((da - db).abs() <= step * 1.01 + 1e-3).all())



def _on_stale_pages(write, byte: int = 0xA5):
    """``write``, whose first call fills the code pools with ``byte`` first (pages a previous owner left)."""
    calls = []

    def call(*args, **kwargs):
        if not calls:
            a = CacheWriteArgs(*args, **kwargs)
            a.k_codes.fill_(byte)
            a.v_codes.fill_(byte)
        calls.append(1)
        return write(*args, **kwargs)

    return call


@pytest.mark.parametrize("chunk,block_t,hits", [(5, 16, None), (3, None, [40, 70])], ids=["chunks", "hits"])
def test_triton_write_masked_pages_match_reference(tdevice, chunk, block_t, hits):
    """INT2 at head_dim 128 (masked pages, 4 tokens per key byte): chunk edges and hit starts
    inside 4-token groups, 16-row programs whose groups straddle programs, then decode steps, over
    code pools full of stale bytes (a write clears its own bit pairs; no page is zeroed when
    taken): the pools equal the reference's bitwise."""
    from functools import partial

    from oscar_compile.kernels.cache_write.cache_write_triton import cache_write_triton

    kw = dict(num_kv_heads=2, head_dim=128, page_size=16, sink=16, recent=16, bits=2, group_size=128,
              seed=15, chunk=chunk, hits=hits, extra_tokens=3)
    cases = []
    for write, dev in ((cache_write_ref, "cpu"), (partial(cache_write_triton, block_t=block_t), tdevice)):
        case = build_case([70, 95], write=_on_stale_pages(write), device=dev, **kw)
        gen = torch.Generator().manual_seed(17)
        for _ in range(3):  # decode steps: one demotion per sequence each
            k, v = random_kv(2, 2, 128, gen), random_kv(2, 2, 128, gen)
            cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=dev)
            write(k.to(dev), v.to(dev), cu, case.cache_lens, case.window_table, case.quant_table, *case.pools,
                  16, 16, 2, 128, case.clip_k, case.clip_v, history_lens=case.history_lens)
            case.append(k.to(dev), v.to(dev), cu)
        cases.append(case)
    for a, b, name in zip(cases[1].pools, cases[0].pools, cases[0].pools._fields, strict=True):
        assert torch.equal(a.cpu(), b), name


_COMPILE = """
import json, re
from oscar_compile.kernels.cache_write.cache_write_triton import compile_offline

def fire_and_forget(ptx, op):
    # red.<op>, or (Triton 3.6) atom.<op> into a register nothing reads, which ptxas emits as RED
    reds = len(re.findall(r"red\\.global\\.gpu\\.relaxed\\." + op, ptx))
    dests = re.findall(r"atom\\.global\\.gpu\\.relaxed\\." + op + r"\\.b32\\s+(%r\\d+),", ptx)
    unread = [d for d in dests if len(re.findall(re.escape(d) + r"(?!\\d)", ptx)) == 1]
    return reds + len(unread), len(dests) - len(unread)

out = []
for bits, block_t, num_warps in [(2, 1, 1), (2, 16, 4), (4, 1, 1)]:
    ptx = compile_offline(bits, 128, 16, block_t, num_warps).asm["ptx"]
    (and_, and_read), (or_, or_read) = fire_and_forget(ptx, "and"), fire_and_forget(ptx, "or")
    local = ("ld.local" in ptx) or ("st.local" in ptx)
    out.append({"local": local, "and": and_, "or": or_, "read": and_read + or_read})
print(json.dumps(out))
"""


def test_masked_write_compiles_for_sm90_with_fire_and_forget_atomics():
    """An offline sm_90 compile of the write (decode: 1 row, 1 warp; prefill: 16 rows, 4 warps):
    masked INT2 key rows become ``red`` AND / OR (no returned value to wait for: Triton 3.9
    writes ``red``, 3.6 an ``atom`` whose result no instruction reads), no spills; INT4 (planar)
    has none. In a child process: under TRITON_INTERPRET=1 the kernel is an
    interpreter function."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    decode, prefill, int4 = json.loads(res.stdout.strip().splitlines()[-1])
    assert not any(r["local"] for r in (decode, prefill, int4))
    assert decode["and"] >= 1 and decode["or"] >= 1 and prefill["and"] >= 1 and prefill["or"] >= 1
    assert int4["and"] == int4["or"] == 0 and not any(r["read"] for r in (decode, prefill, int4))
