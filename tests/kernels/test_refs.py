"""The plain-torch references against a dense computation written independently here.

The dense oracle: for a sequence holding L tokens, position p is quantize-dequantized
(``oscar_compile.quant.fake_quantize`` of the token rounded to the window dtype) when
S0 <= p < S0 + h (h = max(0, L - W - S0), or the larger history after a prefix-cache hit), else
the window-dtype token itself; then plain softmax attention in float64.
Tolerance 1e-5 relative: the references compute in float32, the oracle in float64, on the same
dequantized numbers, so only float32 rounding of the dot products and sums separates them.
"""
from __future__ import annotations

import pytest
import torch

from oscar_compile import quant
from oscar_compile.kernels import ops
from oscar_compile.kernels.attention.decode.attention_ref import attention_ref
from oscar_compile.kernels.cache_write.cache_write_ref import cache_write_ref
from oscar_compile.kernels.elementwise.rotate_ref import rotate_ref
from oscar_compile.kernels.testing import build_case, random_kv, with_standard_history_lens

RTOL = 1e-5


def dense_cached(case, i: int, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 [L, H_kv, D] keys and values of sequence i holding L tokens, history fake-quantized."""
    h = max(0, L - case.recent - case.sink) if case.history_lens is None else int(case.history_lens[i])
    out = []
    for stream, clip in ((case.keys[i], case.clip_k), (case.values[i], case.clip_v)):
        x = stream[:L].double()
        hist = slice(case.sink, case.sink + h)  # rows quantize independently
        x[hist] = quant.fake_quantize(stream[hist].float(), case.bits, case.group_size, clip,
                                      case.pools.k_scale.dtype).double()
        out.append(x)
    return out[0], out[1]


def dense_attention(q, keys, vals, L, scale):
    """q: [T, H_q, D]; keys, vals: [L + T, H_kv, D] -> [T, H_q, D] float64, one query at a time."""
    T, H_q, D = q.shape
    kv_head = torch.arange(H_q) // (H_q // keys.shape[1])  # query head j reads KV head j // g
    out = torch.zeros(T, H_q, D, dtype=torch.float64)
    for t in range(T):
        n = L + t + 1
        kk, vv = keys[:n, kv_head].double(), vals[:n, kv_head].double()  # [n, H_q, D]
        s = (kk * q[t].double()).sum(-1) * scale  # [n, H_q]
        p = torch.softmax(s, dim=0)
        out[t] = (p[..., None] * vv).sum(0)
    return out


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- rotate
@pytest.mark.parametrize("H,H_r", [(8, 1), (8, 8), (8, 2), (32, 8)])
@pytest.mark.parametrize("centre", [False, True])
def test_rotate_ref_matches_per_head_loop(H, H_r, centre):
    gen = torch.Generator().manual_seed(1)
    B, T, D = 2, 5, 64
    x = torch.randn(B, H, T, D, generator=gen).to(torch.bfloat16)
    rot = torch.linalg.qr(torch.randn(H_r, D, D, generator=gen, dtype=torch.float64))[0].float()
    mean = torch.randn(H_r, D, generator=gen) if centre else None
    out = rotate_ref(x, rot, mean)
    assert out.dtype == x.dtype and out.shape == x.shape
    g = H // H_r
    for h in range(H):
        xh = x[:, h].double() - (mean[h // g].double() if centre else 0)
        want = (xh @ rot[h // g].double()).to(torch.bfloat16)
        # one bf16 rounding of a float32 result: at most one bf16 ulp apart from the float64 one
        torch.testing.assert_close(out[:, h].float(), want.float(), rtol=2 ** -7, atol=1e-6)
    torch.testing.assert_close(ops.rotate(x, rot, mean), out, rtol=0, atol=0)


# ----------------------------------------------------------------------------- cache write
WINDOWS = [(16, 32), (0, 0), (0, 16), (16, 0), (32, 64)]


@pytest.mark.parametrize("sink,recent", WINDOWS)
@pytest.mark.parametrize("bits,sdt", [(2, torch.float16), (4, torch.bfloat16), (2, torch.float32), (16, torch.float16)])
@pytest.mark.parametrize("chunk", [1, 7])
def test_bulk_write_equals_token_by_token(sink, recent, bits, sdt, chunk):
    lens = [0, 5, 16, 47, 48, 49, 130]  # empty, < sink, page boundaries, > sink + recent
    kw = dict(num_kv_heads=2, head_dim=64, page_size=16, sink=sink, recent=recent, bits=bits,
              group_size=32, scale_dtype=sdt, seed=3)
    bulk = build_case(lens, **kw)
    step = build_case(lens, chunk=chunk, **kw)
    for a, b, name in zip(bulk.pools, step.pools, bulk.pools._fields, strict=True):
        assert torch.equal(a, b), name


def test_write_quantizes_window_dtype_tokens():
    """A float32 token sent straight to history is rounded to the window dtype first."""
    gen = torch.Generator().manual_seed(0)
    kw = dict(num_kv_heads=1, head_dim=64, page_size=16, sink=0, recent=0, group_size=64)
    case = build_case([0], extra_tokens=1, **kw)
    k = random_kv(1, 1, 64, gen, torch.float32)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    cache_write_ref(k, k, cu, case.cache_lens, case.window_table, case.quant_table, *case.pools,
                    0, 0, 2, 64, 0.96, 0.92)
    packed, s, z = quant.quantize(k.to(torch.bfloat16)[0], 2, 64, 0.96, torch.float16)
    page = case.quant_table[0, 0]
    assert torch.equal(case.pools.k_codes[page, :, 0], packed)
    assert torch.equal(case.pools.k_scale[page, :, 0], s)


# ----------------------------------------------------------------------------- attention
def run_chunk_attention(case, chunk_lens, H_q, seed, q_dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    H_kv, D = case.pools.k_win.shape[1], case.pools.k_win.shape[3]
    q = random_kv(sum(chunk_lens), H_q, D, gen, q_dtype)
    k = random_kv(sum(chunk_lens), H_kv, D, gen, case.pools.k_win.dtype)
    v = random_kv(sum(chunk_lens), H_kv, D, gen, case.pools.k_win.dtype)
    cu = torch.tensor([0] + chunk_lens).cumsum(0).to(torch.int32)
    scale = D ** -0.5
    out = attention_ref(q, k, v, cu, case.cache_lens, case.window_table, case.quant_table,
                        *case.pools, scale, case.sink, case.recent, case.bits, case.group_size,
                        case.history_lens)
    return q, k, v, cu, scale, out


def assert_matches_dense(case, q, k, v, cu, scale, out, tol):
    """Every sequence's chunk output equals dense attention over its dequantized cache + chunk."""
    for i, L in enumerate(case.cache_lens.tolist()):
        a, b = cu[i].item(), cu[i + 1].item()
        if a == b:
            continue
        kc, vc = dense_cached(case, i, L)
        want = dense_attention(q[a:b], torch.cat([kc, k[a:b].double()]),
                               torch.cat([vc, v[a:b].double()]), L, scale)
        assert rel_err(out[a:b], want) < tol


@pytest.mark.parametrize("sink,recent", WINDOWS)
@pytest.mark.parametrize("H_q,H_kv", [(2, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("D,G", [(64, 32), (128, 128)])
@pytest.mark.parametrize("bits,sdt", [(2, torch.float16), (4, torch.bfloat16), (2, torch.float32), (16, torch.float16)])
def test_attention_ref_matches_dense(sink, recent, H_q, H_kv, D, G, bits, sdt):
    lens = [0, 7, 48, 100]
    chunk_lens = [3, 1, 0, 5]
    case = build_case(lens, H_kv, D, 16, sink, recent, bits, G, sdt, seed=5, extra_tokens=8)
    q, k, v, cu, scale, out = run_chunk_attention(case, chunk_lens, H_q, seed=6)
    assert out.dtype == q.dtype
    # out is rounded to bf16 once: compare the float32 result through a float32 call too
    assert_matches_dense(case, q, k, v, cu, scale, out, 2 ** -8)
    out32 = attention_ref(q.float(), k, v, cu, case.cache_lens, case.window_table,
                          case.quant_table, *case.pools, scale, sink, recent, bits, G)
    assert_matches_dense(case, q, k, v, cu, scale, out32, RTOL)


def _full_precision_pages(case, room: int, page_size: int = 16):
    """Every written token of ``case`` in full-precision pages: (page_table, k_pages, v_pages)."""
    lens = case.cache_lens.tolist()
    per_seq = [-(-(L + room) // page_size) for L in lens]
    table = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    shape = (sum(per_seq), *case.pools.k_win.shape[1:])
    k_pages = torch.zeros(shape, dtype=case.pools.k_win.dtype)
    v_pages = torch.zeros(shape, dtype=case.pools.k_win.dtype)
    first = 0
    for i, L in enumerate(lens):
        table[i, :per_seq[i]] = torch.arange(first, first + per_seq[i])
        first += per_seq[i]
        pos = torch.arange(L)
        k_pages[table[i, pos // page_size].long(), :, pos % page_size] = case.keys[i]
        v_pages[table[i, pos // page_size].long(), :, pos % page_size] = case.values[i]
    return table, k_pages, v_pages


@pytest.mark.parametrize("sink,recent", WINDOWS)
def test_16_bit_history_is_the_full_precision_paged_cache(sink, recent):
    """bits = 16 (a layer kept at 16 bits beside INT-b layers): whatever the windows, the cache
    holds the written tokens as they are, so attention is the full-precision paged op's."""
    from oscar_compile.kernels.attention.attention_bf16_ref import attention_bf16_ref

    case = build_case([0, 7, 48, 100], 2, 64, 16, sink, recent, 16, 64, seed=5, extra_tokens=8)
    q, k, v, cu, scale, got = run_chunk_attention(case, [3, 1, 0, 5], 8, seed=6)
    want = attention_bf16_ref(q, k, v, cu, case.cache_lens, *_full_precision_pages(case, 8), scale)
    assert rel_err(got, want) < 2 ** -8  # both round to bf16 once from float32


@pytest.mark.parametrize("sink,recent", [(16, 32), (0, 0)])
def test_prefill_then_decode_steps(sink, recent):
    """Attention then write, chunk after chunk and token after token, always equals the dense cache."""
    H_q, H_kv, D = 4, 2, 64
    lens = [0, 0]
    case = build_case(lens, H_kv, D, 16, sink, recent, 2, 64, torch.float16, seed=8, extra_tokens=120)
    case.keys = [torch.empty(0, H_kv, D, dtype=torch.bfloat16) for _ in lens]
    case.values = [torch.empty(0, H_kv, D, dtype=torch.bfloat16) for _ in lens]
    for step, chunk_lens in enumerate([[50, 33], [1, 1], [1, 0], [20, 1], [1, 1]]):
        q, k, v, cu, scale, out = run_chunk_attention(case, chunk_lens, H_q, seed=10 + step,
                                                      q_dtype=torch.float32)
        assert_matches_dense(case, q, k, v, cu, scale, out, RTOL)
        ops.cache_write(k, v, cu, case.cache_lens, case.window_table, case.quant_table,
                        *case.pools, sink, recent, 2, 64, 0.96, 0.92)
        for i in range(len(lens)):
            case.keys[i] = torch.cat([case.keys[i], k[cu[i]:cu[i + 1]]])
            case.values[i] = torch.cat([case.values[i], v[cu[i]:cu[i + 1]]])
        case.cache_lens += torch.tensor(chunk_lens, dtype=torch.int32)


# ----------------------------------------------------------------------------- history_lens
# After a prefix-cache hit past the sink (runtime/core/page_manager.py) a sequence holds sink
# [0, S0), shared history [S0, S0 + h) and a ring of fewer than W tokens [S0 + h, L).
# (hits, cache_lens) per sequence, S0 = 16, W = 32, P = 16: standard (h = 22, derived), right
# after a hit (h = 48, empty ring), ring of 20 wrapping past the ring's end (starts at slot
# 16 + 48 % 32), ring of 13 from slot 16, a sequence shorter than the sink, a hit on the sink only.
HITS = [0, 64, 64, 48, 0, 32, 16]
HIT_LENS = [70, 64, 84, 61, 5, 40, 30]


@pytest.mark.parametrize("sink,recent", WINDOWS)
@pytest.mark.parametrize("chunk", [None, 7])
def test_standard_history_lens_change_nothing(sink, recent, chunk):
    """history_lens = max(0, L - W - S0) given explicitly: pools and outputs bitwise as with None."""
    lens = [0, 5, 16, 47, 48, 49, 130]
    kw = dict(num_kv_heads=2, head_dim=64, page_size=16, sink=sink, recent=recent, group_size=32,
              seed=3, chunk=chunk, extra_tokens=8)
    plain = build_case(lens, **kw)
    given = build_case(lens, write=with_standard_history_lens(cache_write_ref), **kw)
    for a, b, name in zip(plain.pools, given.pools, plain.pools._fields, strict=True):
        assert torch.equal(a, b), name
    q, k, v, cu, scale, out = run_chunk_attention(plain, [3, 1, 0, 8, 1, 2, 1], 4, seed=4)
    derived = (plain.cache_lens - recent - sink).clamp_min(0).to(torch.int32)
    again = attention_ref(q, k, v, cu, plain.cache_lens, plain.window_table, plain.quant_table,
                          *plain.pools, scale, sink, recent, 2, 32, derived)
    assert torch.equal(out, again)


@pytest.mark.parametrize("H_q,H_kv", [(2, 2), (8, 2)])
@pytest.mark.parametrize("D,G", [(64, 32), (128, 128)])
@pytest.mark.parametrize("chunk_lens", [[1] * 7, [3, 40, 33, 1, 5, 2, 0]])
def test_attention_after_prefix_hits_matches_dense(H_q, H_kv, D, G, chunk_lens):
    """Shared history [S0, S0 + h) dequantized, only the ring slots of [S0 + h, L) read (the
    others hold stale garbage), chunks of 1 token and longer than W."""
    case = build_case(HIT_LENS, H_kv, D, group_size=G, seed=7, extra_tokens=40, hits=HITS)
    assert case.history_lens.tolist() == [22, 48, 48, 32, 0, 16, 0]
    q, k, v, cu, scale, out = run_chunk_attention(case, chunk_lens, H_q, seed=8, q_dtype=torch.float32)
    assert_matches_dense(case, q, k, v, cu, scale, out, RTOL)


@pytest.mark.parametrize("chunk", [None, 1])
def test_writes_after_prefix_hits_keep_shared_history(chunk):
    """Step after step (one token, chunks crossing W) from the hit states: shared history rows
    are never written, demotions land in rows >= h, and attention sees the dense cache."""
    S0, W, P = 16, 32, 16
    case = build_case(HIT_LENS, 2, 64, group_size=64, seed=9, chunk=chunk, extra_tokens=90, hits=HITS)
    shared = [(int(case.quant_table[i, h // P]), h % P) for i, R in enumerate(HITS) for h in range(max(0, R - S0))]
    pages, rows = (torch.tensor(x) for x in zip(*shared, strict=True))
    before = [pool[pages, :, rows].clone() for pool in case.pools[2:]]  # codes, scales, zeros of K, V
    steps = [[1] * 7, [40, 1, 13, 33, 2, 1, 0], [1] * 7, [9, 0, 2, 1, 20, 3, 1]]
    for step, chunk_lens in enumerate(steps):
        q, k, v, cu, scale, out = run_chunk_attention(case, chunk_lens, 4, seed=20 + step, q_dtype=torch.float32)
        assert_matches_dense(case, q, k, v, cu, scale, out, RTOL)
        ops.cache_write(k, v, cu, case.cache_lens, case.window_table, case.quant_table, *case.pools,
                        S0, W, 2, 64, 0.96, 0.92, history_lens=case.history_lens)
        case.append(k, v, cu)
    for pool, old in zip(case.pools[2:], before, strict=True):
        assert torch.equal(pool[pages, :, rows], old)
    q, k, v, cu, scale, out = run_chunk_attention(case, [1] * 7, 4, seed=30, q_dtype=torch.float32)
    assert_matches_dense(case, q, k, v, cu, scale, out, RTOL)  # the rows demoted last read back


@pytest.mark.parametrize("H_r", [1, 2])
def test_rotation_leaves_window_attention_unchanged(H_r):
    """q R . (k - mu) R = q . k - q . mu: with every token in the windows, rotating is invisible."""
    gen = torch.Generator().manual_seed(2)
    H_q, H_kv, D = 8, 2, 64
    rot = torch.linalg.qr(torch.randn(H_r, D, D, generator=gen, dtype=torch.float64))[0].float()
    mean = torch.randn(H_r, D, generator=gen)
    case = build_case([0], H_kv, D, 16, 16, 32, group_size=64, extra_tokens=40)
    q = torch.randn(40, H_q, D, generator=gen)
    k, v = torch.randn(2, 40, H_kv, D, generator=gen)
    cu = torch.tensor([0, 40], dtype=torch.int32)
    args = (cu, case.cache_lens, case.window_table, case.quant_table, *case.pools, D ** -0.5, 16, 32, 2, 64)
    plain = attention_ref(q, k, v, *args)
    rq = rotate_ref(q.transpose(0, 1)[None], rot)[0].transpose(0, 1)
    rk = rotate_ref(k.transpose(0, 1)[None], rot, mean)[0].transpose(0, 1)
    assert rel_err(attention_ref(rq, rk, v, *args), plain) < 1e-5


def test_fused_rotation_write_matches_rotate_then_write():
    gen = torch.Generator().manual_seed(4)
    H_kv, D = 2, 64
    rot = torch.linalg.qr(torch.randn(H_kv, D, D, generator=gen, dtype=torch.float64))[0].float()
    mean = torch.randn(H_kv, D, generator=gen)
    a = build_case([0], H_kv, D, 16, 16, 16, group_size=64, extra_tokens=70)
    b = build_case([0], H_kv, D, 16, 16, 16, group_size=64, extra_tokens=70)
    k, v = random_kv(70, H_kv, D, gen), random_kv(70, H_kv, D, gen)
    cu = torch.tensor([0, 70], dtype=torch.int32)
    tail = (16, 16, 2, 64, 0.96, 0.92)
    ops.cache_write(k, v, cu, a.cache_lens, a.window_table, a.quant_table, *a.pools, *tail,
                    rot_k=rot, mean_k=mean)
    rk = rotate_ref(k.transpose(0, 1)[None], rot, mean)[0].transpose(0, 1)
    ops.cache_write(rk, v, cu, b.cache_lens, b.window_table, b.quant_table, *b.pools, *tail)
    for x, y in zip(a.pools, b.pools, strict=True):
        assert torch.equal(x, y)


def test_ops_fake_and_compile_trace():
    """The ops trace under torch.compile's fake tensors (register_fake is consistent)."""
    case = build_case([20], 2, 64, 16, 16, 16, group_size=64, extra_tokens=2)
    q = torch.randn(2, 4, 64).to(torch.bfloat16)
    k = v = torch.randn(2, 2, 64).to(torch.bfloat16)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    args = (q, k, v, cu, case.cache_lens, case.window_table, case.quant_table, *case.pools,
            0.125, 16, 16, 2, 64)
    history_lens = torch.tensor([4], dtype=torch.int32)  # [16, 20) in the history (standard: none)
    for extra in ((), (history_lens,)):
        torch.library.opcheck(torch.ops.oscar.attention.default, (*args, *extra),
                              test_utils=("test_schema", "test_faketensor"))
    wargs = (k, v, cu, case.cache_lens, case.window_table, case.quant_table, *case.pools,
             16, 16, 2, 64, 0.96, 0.92)
    for kwargs in ({}, {"history_lens": history_lens}):
        torch.library.opcheck(torch.ops.oscar.cache_write.default, wargs, kwargs,
                              test_utils=("test_schema", "test_faketensor"))


def test_every_cuda_registration_names_an_existing_triton_wrapper():
    """A CUDA implementation whose Triton module is missing would fall back to the reference
    silently (as oscar::rotate's once did)."""
    import inspect
    import re

    pytest.importorskip("triton")
    source = inspect.getsource(ops)
    pairs = set(re.findall(r'_triton_impl\("([\w.]+)", "(\w+)"\)', source))
    pairs |= set(re.findall(r'_triton_on_cuda\(\s*\w+,\s*\w+,\s*"([\w.]+)",\s*"(\w+)"', source))
    assert len(pairs) >= 7
    for module, name in sorted(pairs):
        assert ops._triton_impl(module, name) is not None, f"oscar_compile.kernels.{module}.{name}"



# ----------------------------------------------------------------------------- masked INT2 pages
@pytest.mark.parametrize("chunk,hits", [(None, None), (5, None), (1, None), (3, [40, 90])],
                         ids=["bulk", "chunks", "decode", "hits"])
def test_masked_pages_hold_the_pack_of_the_quantized_tokens(chunk, hits):
    """INT2 at head_dim 128 (masked pages): after a bulk write, chunk edges inside 4-token groups,
    decode steps and prefix-hit starts, each history row holds the quantizer's codes of its token
    and each full page is the bulk pack (code_layout_ref.pack_page) of its 16 rows."""
    from oscar_compile.kernels.layout import code_layout_ref as cl
    from oscar_compile.kernels.pools import history_lens_of

    sink, recent, P, H = 16, 32, 16, 2
    case = build_case([100, 150], H, 128, P, sink, recent, 2, 128, torch.float16, chunk=chunk, hits=hits, seed=7)
    for i, h in enumerate(history_lens_of(case.cache_lens, case.history_lens, sink, recent)):
        for kind, stream, clip, pool in (("k", case.keys[i], case.clip_k, case.pools.k_codes),
                                         ("v", case.values[i], case.clip_v, case.pools.v_codes)):
            x = quant.clip_per_token(stream[sink:sink + h], clip)
            codes = quant.quantize_groups(x, 2, 128, torch.float16)[0]  # [h, H, D]
            n_full = h // P
            full = codes[:n_full * P].view(n_full, P, H, 128).transpose(1, 2)  # [pages, H, P, D]
            assert torch.equal(pool[case.quant_table[i, :n_full].long()], cl.pack_page(full, kind, 2))
            pos = torch.arange(h)
            got = cl.read_code_rows(pool, case.quant_table[i, pos // P].long(), pos % P, kind, 2)
            assert torch.equal(got, codes)
