"""Triton paged attention (decode and extend) against attention_ref on small ragged batches.

Tolerance: relative Frobenius error 1e-2 for bf16 outputs. The kernel rounds the softmax
weights to bf16 for the window/chunk dots (2^-9 relative each) and p * scale to fp16 for the
history dots (2^-12), sums in another float32 order, and the output itself is rounded to bf16
(2^-9): a few 1e-3 in norm, so 1e-2 catches any indexing or masking error (those give O(1)).
Under the interpreter the full-precision dots run in float32 (dot_dtype) and the final cast to
bf16 truncates (one spacing, 2^-8 relative, instead of half of one): still well inside 1e-2.
"""
from __future__ import annotations

import contextlib
import importlib
from unittest import mock

import pytest
import torch

from oscar_compile.kernels.attention.decode.attention_ref import attention_ref
from oscar_compile.kernels.testing import build_case, random_kv

TOL = 1e-2


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def merged_views(q, k, v):
    """The same values as the runtime passes them: q, k, v views of one merged projection output
    [N, (H_q + 2 H_kv) * D], then k replaced by a fresh tensor (as RoPE returns it): three
    different row strides."""
    n, D = q.shape[0], q.shape[2]
    merged = torch.cat([t.reshape(n, -1) for t in (q, k, v)], dim=1)
    hq, hk = q.shape[1] * D, k.shape[1] * D
    views = [merged[:, :hq], merged[:, hq:hq + hk], merged[:, hq + hk:]]
    q, k, v = (x.unflatten(1, (-1, D)) for x in views)
    return q, k.contiguous(), v


def run_both(case, chunk_lens, H_q, device, seed=0, merged=False, **kw):
    from oscar_compile.kernels.attention.decode.attention_triton import attention_triton

    gen = torch.Generator().manual_seed(seed)
    H_kv, D = case.pools.k_win.shape[1], case.pools.k_win.shape[3]
    n = sum(chunk_lens)
    q = random_kv(n, H_q, D, gen, device=device)
    k = random_kv(n, H_kv, D, gen, device=device)
    v = random_kv(n, H_kv, D, gen, device=device)
    if merged:
        q, k, v = merged_views(q, k, v)
        assert k.stride(0) != v.stride(0)
    cu = torch.tensor([0] + chunk_lens, device=device).cumsum(0).to(torch.int32)
    args = (q, k, v, cu, case.cache_lens, case.window_table, case.quant_table, *case.pools,
            D ** -0.5, case.sink, case.recent, case.bits, case.group_size, case.history_lens)
    with kernel_must_run("attention.decode.attention_ref"):
        got = attention_triton(*args, **kw)
    return got, attention_ref(*args)


@contextlib.contextmanager
def kernel_must_run(ref_module: str):
    """Make the wrapper's fallback to its reference (for shapes the kernel does not take) raise:
    a test of such a shape would otherwise compare the reference with itself."""
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton wrapper fell back to its reference")

    module = importlib.import_module(f"oscar_compile.kernels.{ref_module}")
    with mock.patch.object(module, ref_module.rpartition(".")[2], refuse):
        yield


CASES = [  # sink, recent, H_q, H_kv, D, bits, G, scale dtype
    (16, 32, 4, 2, 64, 2, 64, torch.float16),
    (0, 0, 2, 2, 64, 2, 16, torch.bfloat16),
    (16, 0, 8, 1, 128, 2, 128, torch.float32),
    (0, 16, 4, 1, 64, 4, 32, torch.float16),
    (32, 16, 2, 1, 128, 2, 64, torch.float16),
    # layers kept at 16 bits beside INT-b layers (history rows as stored; G, scale dtype unused)
    (16, 32, 8, 2, 64, 16, 64, torch.float16),
    (16, 16, 4, 1, 128, 16, 128, torch.float16),
    # masked INT2 pages whose groups split a value bit pair's channels (planar bytes rebuilt)
    (16, 32, 4, 2, 128, 2, 32, torch.float16),
]


@pytest.mark.parametrize("sink,recent,H_q,H_kv,D,bits,G,sdt", CASES)
def test_decode_matches_reference(tdevice, sink, recent, H_q, H_kv, D, bits, G, sdt):
    lens = [0, 9, 48, 150]  # empty cache, < sink + recent, page boundary, long history
    case = build_case(lens, H_kv, D, 16, sink, recent, bits, G, sdt, seed=1, extra_tokens=4,
                      device=tdevice)
    got, want = run_both(case, [1, 1, 1, 1], H_q, tdevice)
    assert got.dtype == want.dtype and rel_err(got, want) < TOL


@pytest.mark.parametrize("sink,recent,H_q,H_kv,D,bits,G,sdt", CASES[:3] + CASES[5:6])
def test_extend_matches_reference(tdevice, sink, recent, H_q, H_kv, D, bits, G, sdt):
    lens = [0, 40, 100]
    case = build_case(lens, H_kv, D, 16, sink, recent, bits, G, sdt, seed=2, extra_tokens=40,
                      device=tdevice)
    got, want = run_both(case, [37, 0, 20], H_q, tdevice, seed=3)
    assert rel_err(got, want) < TOL


@pytest.mark.parametrize("chunk_lens", [[37, 0, 20], [1, 1, 1]], ids=["extend", "decode"])
def test_merged_projection_views_match_reference(tdevice, chunk_lens):
    """q, k, v with different row strides (the runtime's merged q/k/v projection): the chunk's
    values are read with v's stride, not k's (they once were: every extend step was wrong)."""
    sink, recent, H_q, H_kv, D, bits, G, sdt = CASES[0]
    case = build_case([0, 40, 100], H_kv, D, 16, sink, recent, bits, G, sdt, seed=2, extra_tokens=40,
                      device=tdevice)
    got, want = run_both(case, chunk_lens, H_q, tdevice, seed=3, merged=True)
    assert rel_err(got, want) < TOL


@pytest.mark.parametrize("bits", [2, 16])
def test_split_history_matches_reference(tdevice, bits):
    """Force several history splits (flash-decoding partials + merge) on a small problem."""
    import oscar_compile.kernels.attention.decode.attention_triton as at

    case = build_case([200, 70], 1, 64, 16, 16, 16, bits, 64, torch.float16, seed=4, extra_tokens=2,
                      device=tdevice)
    orig = at.plan_launch
    at.plan_launch = lambda *a, **k: (1, 16, 3)
    try:
        got, want = run_both(case, [1, 2], 4, tdevice, seed=5, block_n=16)
    finally:
        at.plan_launch = orig
    assert rel_err(got, want) < TOL


@pytest.mark.parametrize("win_splits", [1, 2, 5])
def test_window_splits_match_reference(tdevice, win_splits):
    """The sink + recent slots (16 + 32: three 16-slot blocks) shared by 1, 2 or 5 programs (5:
    two of them get no block); the last one also takes the chunk's own keys. Decode and a
    two-token chunk, after a prefix hit too."""
    case = build_case([200, 70, 20], 1, 64, 16, 16, 32, 2, 64, torch.float16, seed=12,
                      extra_tokens=2, device=tdevice, hits=[0, 64, 0])
    got, want = run_both(case, [1, 2, 1], 4, tdevice, seed=13, block_n=16, block_w=16, nsplit=2,
                         win_splits=win_splits)
    assert rel_err(got, want) < TOL


def test_planned_window_splits_match_reference(tdevice, monkeypatch):
    """The wrapper's own plan shares the windows (16 + 32 slots: three 16-slot blocks, against
    2-block history splits: two window programs), decode rows after a prefix hit."""
    import oscar_compile.kernels.attention.decode.attention_triton as at

    planned = []
    plan = at.plan_window_splits
    monkeypatch.setattr(at, "plan_window_splits", lambda *a: planned.append(plan(*a)) or planned[-1])
    monkeypatch.setattr(at, "plan_launch", lambda *a, **k: (1, 16, 3))
    case = build_case([40, 70, 20], 1, 64, 16, 16, 32, 2, 64, torch.float16, seed=14,
                      extra_tokens=2, device=tdevice, hits=[0, 64, 0])
    got, want = run_both(case, [1, 1, 1], 4, tdevice, seed=15, block_n=16, block_w=16)
    assert planned == [2] and rel_err(got, want) < TOL


@pytest.mark.parametrize("win_splits", [None, 2])
def test_split_extend_chunks_match_reference(tdevice, monkeypatch, win_splits):
    """Extend chunks (16-row query blocks, chunks longer than BLOCK_C) over split histories, after
    a prefix hit; the windows in one program (planned) or two (forced)."""
    import oscar_compile.kernels.attention.decode.attention_triton as at

    monkeypatch.setattr(at, "plan_launch", lambda *a, **k: (4, 16, 3))
    case = build_case([150, 90, 40], 1, 64, 16, 16, 32, 2, 64, torch.float16, seed=16,
                      extra_tokens=80, device=tdevice, hits=[0, 80, 0])
    got, want = run_both(case, [70, 9, 33], 4, tdevice, seed=17, block_n=16, block_w=16,
                         win_splits=win_splits)
    assert rel_err(got, want) < TOL


# (hit, L), S0 = 16, W = 32: standard (h = 22); right after a hit (h = 48, empty ring); a ring
# of 20 wrapping past the ring's end; a ring of 13; shorter than the sink
HITS, HIT_LENS = [0, 64, 64, 48, 0], [70, 64, 84, 61, 5]


@pytest.mark.parametrize("H_q,H_kv,D,G", [(2, 2, 64, 32), (8, 2, 128, 128)])
@pytest.mark.parametrize("chunk_lens", [[1] * 5, [3, 34, 1, 2, 2]])
def test_after_prefix_hits_matches_reference(tdevice, H_q, H_kv, D, G, chunk_lens):
    """history_lens past the standard: history rows [0, h), only the ring slots of [S0 + h, L)
    (the others hold stale garbage); decode and chunks longer than W."""
    case = build_case(HIT_LENS, H_kv, D, group_size=G, seed=6, extra_tokens=40, hits=HITS,
                      device=tdevice)
    got, want = run_both(case, chunk_lens, H_q, tdevice, seed=7)
    assert rel_err(got, want) < TOL


@pytest.mark.parametrize("bits", [2, 16])
def test_split_history_after_prefix_hits_matches_reference(tdevice, bits):
    """Flash-decoding splits of a history whose length comes from history_lens."""
    import oscar_compile.kernels.attention.decode.attention_triton as at

    case = build_case([190, 90, 120], 1, 64, 16, 16, 32, bits, 64, torch.float16, seed=8,
                      extra_tokens=2, device=tdevice, hits=[176, 0, 96])
    assert case.history_lens.tolist() == [160, 42, 80]  # three non-empty splits each
    orig = at.plan_launch
    at.plan_launch = lambda *a, **k: (1, 16, 3)
    try:
        got, want = run_both(case, [1, 2, 1], 4, tdevice, seed=9, block_n=16)
    finally:
        at.plan_launch = orig
    assert rel_err(got, want) < TOL


def test_standard_history_lens_change_nothing(tdevice):
    """history_lens = max(0, L - W - S0) given explicitly: the output bitwise as with None."""
    from oscar_compile.kernels.attention.decode.attention_triton import attention_triton

    case = build_case([0, 9, 48, 150], 2, 64, 16, 16, 32, 2, 64, torch.float16, seed=10,
                      extra_tokens=4, device=tdevice)
    derived = (case.cache_lens - 48).clamp_min(0).to(torch.int32)
    gen = torch.Generator().manual_seed(11)
    q = random_kv(7, 4, 64, gen, device=tdevice)
    k, v = random_kv(7, 2, 64, gen, device=tdevice), random_kv(7, 2, 64, gen, device=tdevice)
    cu = torch.tensor([0, 1, 2, 3, 7], dtype=torch.int32, device=tdevice)
    args = (q, k, v, cu, case.cache_lens, case.window_table, case.quant_table, *case.pools,
            0.125, 16, 32, 2, 64)
    assert torch.equal(attention_triton(*args), attention_triton(*args, derived))


@pytest.mark.parametrize("chunk_lens", [[1, 1, 1], [5, 0, 30]])
@pytest.mark.parametrize("H_q,H_kv,D", [(2, 2, 64), (8, 2, 128), (8, 1, 128)])  # GQA 1 / 4 / 8
@pytest.mark.parametrize("split", [False, True])
def test_bf16_paged_matches_reference(tdevice, monkeypatch, chunk_lens, H_q, H_kv, D, split):
    """Full-precision pages: op write + Triton attention against the reference; with ``split``
    the history in three 16-token-block splits (partials + merge_partials)."""
    from functools import partial

    import oscar_compile.kernels.attention.attention_bf16_triton as bt
    from oscar_compile.kernels import ops
    from oscar_compile.kernels.attention.attention_bf16_ref import attention_bf16_ref

    attention_bf16_triton = bt.attention_bf16_triton
    if split:
        monkeypatch.setattr(bt, "plan_launch", lambda N, B, H_kv, g, *a, **k: (
            1 if N <= 2 * B else max(1, 16 // g), 16, 3))
        attention_bf16_triton = partial(attention_bf16_triton, block_n=16)

    gen = torch.Generator().manual_seed(7)
    lens, P = [0, 21, 64], 16
    need = [-(-(L + t) // P) for L, t in zip(lens, chunk_lens, strict=True)]
    perm = torch.randperm(sum(need) + 1, generator=gen).to(torch.int32)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at:at + n]
        at += n
    table = table.to(tdevice)
    k_pages = torch.zeros(sum(need) + 1, H_kv, P, D, dtype=torch.bfloat16, device=tdevice)
    v_pages = torch.zeros_like(k_pages)
    cache_lens = torch.zeros(3, dtype=torch.int32, device=tdevice)
    cu = torch.tensor([0] + lens, device=tdevice).cumsum(0).to(torch.int32)
    ops.cache_write_bf16(random_kv(sum(lens), H_kv, D, gen, device=tdevice),
                         random_kv(sum(lens), H_kv, D, gen, device=tdevice), cu, cache_lens,
                         table, k_pages, v_pages)
    cache_lens = torch.tensor(lens, dtype=torch.int32, device=tdevice)
    n = sum(chunk_lens)
    q = random_kv(n, H_q, D, gen, device=tdevice)
    k, v = random_kv(n, H_kv, D, gen, device=tdevice), random_kv(n, H_kv, D, gen, device=tdevice)
    cu = torch.tensor([0] + chunk_lens, device=tdevice).cumsum(0).to(torch.int32)
    for qkv in ((q, k, v), merged_views(q, k, v)):  # separate tensors, merged-projection views
        args = (*qkv, cu, cache_lens, table, k_pages, v_pages, D ** -0.5)
        with kernel_must_run("attention.attention_bf16_ref"):
            got = attention_bf16_triton(*args)
        assert rel_err(got, attention_bf16_ref(*args)) < TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H_kv,D", [(2, 64), (1, 128), (3, 32)])
def test_bf16_cache_write_is_the_reference_scatter(tdevice, dtype, H_kv, D):
    """Ragged chunks (one empty) on top of cached tokens, crossing page boundaries: bitwise."""
    from oscar_compile.kernels.attention.attention_bf16_ref import cache_write_bf16_ref
    from oscar_compile.kernels.attention.attention_bf16_triton import cache_write_bf16_triton

    gen = torch.Generator().manual_seed(11)
    P, cached, chunks = 16, [0, 15, 40, 3], [17, 1, 0, 30]
    need = [-(-(L + t) // P) for L, t in zip(cached, chunks, strict=True)]
    perm = torch.randperm(sum(need) + 2, generator=gen).to(torch.int32)
    table = torch.full((4, max(need)), -1, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at:at + n]
        at += n
    pages = [torch.randn(sum(need) + 2, H_kv, P, D, generator=gen).to(device=tdevice, dtype=dtype) for _ in range(2)]
    n = sum(chunks)
    k = torch.randn(n, H_kv, D, generator=gen).to(device=tdevice, dtype=dtype)
    v = torch.randn(n, 2 * H_kv, D, generator=gen).to(device=tdevice, dtype=dtype)[:, ::2]  # strided heads
    args = (k, v, torch.tensor([0] + chunks).cumsum(0).to(device=tdevice, dtype=torch.int32),
            torch.tensor(cached, dtype=torch.int32, device=tdevice), table.to(tdevice))
    want = [p.clone() for p in pages]
    cache_write_bf16_ref(*args, *want)
    cache_write_bf16_triton(*args, *pages)
    assert all(torch.equal(a, b) for a, b in zip(pages, want, strict=True))
    # an all-zero write range (a forward without a cache) writes nothing, whatever k and v hold
    nothing = (k, v, torch.zeros_like(args[2]), *args[3:])
    cache_write_bf16_ref(*nothing, *want)
    cache_write_bf16_triton(*nothing, *pages)
    assert all(torch.equal(a, b) for a, b in zip(pages, want, strict=True))


def test_launch_plan_splits_by_whole_blocks_and_caps_split_length(monkeypatch):
    """The plan reads shapes only; numbers for a 132-SM GPU (H200)."""
    import oscar_compile.kernels.attention.decode.attention_triton as at

    monkeypatch.setattr(at, "num_sms", lambda device: 132)
    cuda = torch.device("cuda", 0)

    def nsplit(N, B, max_hist):
        return at.plan_launch(N, B, 8, 4, max_hist, cuda, 128, min_split_blocks=2)[2]

    assert nsplit(1, 1, 32448) == 64  # 32k, batch 1: 254 blocks, 4 per split (63 would leave 13 idle)
    # a batch that fills the GPU needs no splits for speed, but no split may exceed MAX_SPLIT_TOKENS
    assert nsplit(40, 40, 99680) == -(-99680 // at.MAX_SPLIT_TOKENS)
    assert nsplit(64, 64, 4096) == 0
    assert nsplit(8192, 1, 131072) == 0  # a prefill chunk: its partials would be too large
    assert nsplit(1, 1, 7872) == 31  # 8k, batch 1: 62 blocks, 2 per split
    # batch 8 / 32: 64 / 256 programs per split; 8 / 2 splits fill the 528 slots (9 / 3 spill over)
    assert nsplit(8, 8, 32448) == 8
    assert nsplit(32, 32, 7872) == 2
    # never shorter than min_split_blocks: 5 or 9 blocks of 64 in one or two splits of >= 4
    assert [at.plan_launch(1, 1, 8, 4, h, cuda, 64)[2] for h in (320, 576)] == [1, 2]


def test_window_plan_keeps_window_chains_within_a_history_split():
    from oscar_compile.kernels.attention.decode.attention_triton import plan_window_splits

    assert plan_window_splits(10, 2) == 5  # 8k, batch 1: 320 slots in 32-key blocks, 2-block splits
    assert plan_window_splits(10, 4) == 3
    assert plan_window_splits(10, 16) == 1  # 128k, batch 1
    assert plan_window_splits(3, 1) == 3  # never more programs than blocks
    assert plan_window_splits(0, 2) == 1  # no windows: one program still takes the chunk


_COMPILE = """
import json
import os
import re
import subprocess
import tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from oscar_compile.kernels.attention.decode.attention_triton import _attn_kernel

ptrs = dict(q_ptr="bf16", k_ptr="bf16", v_ptr="bf16", cu_ptr="i32", cub_ptr="i32", lens_ptr="i32", hist_ptr="i32",
            wt_ptr="i32", qt_ptr="i32", kwin_ptr="bf16", vwin_ptr="bf16", kc_ptr="u8", ks_ptr="fp16", kz_ptr="fp16",
            vc_ptr="u8", vs_ptr="fp16", vz_ptr="fp16", out_ptr="bf16", po_ptr="fp32", pl_ptr="fp32")
sig = {n: f"*{t}" for n, t in ptrs.items()}
sig.update(qk_scale="fp32")
sig.update({n: "i32" for n in ("B", "nsplit", "nwin", "sqn", "sqh", "skn", "skh", "svn", "svh", "stride_wt",
                               "stride_qt")})
out = []
for masked in (False, True):
    consts = dict(H_KV=8, G_Q=4, D=128, P=16, SINK=64, RECENT=256, BITS=2, GROUP=128, BLOCK_M=1, ROWS=16,
                  BLOCK_N=128, BLOCK_W=32, BLOCK_C=16, SPLIT=True, WIN_SPLIT=False, USE_ASM=True,
                  DOT_DT=triton.language.bfloat16, HAS_HIST=True, MASKED=masked, SPLIT_LEN=0)
    s = dict(sig, **{k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(ptrs))}
    k = triton.compile(ASTSource(_attn_kernel, s, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 2, "maxnreg": 128})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    ptx = k.asm["ptx"]
    out.append({"masked": masked, "local": ("ld.local" in ptx) or ("st.local" in ptx),
                "stack": int(re.search(r"STACK:(\\d+)", res).group(1))})
print(json.dumps(out))
"""


def test_decode_over_masked_pages_compiles_for_sm90():
    """An offline sm_90 compile of the decode launch (the benchmark layer, under the 128-register
    cap) over planar and masked INT2 pages: it builds and spills nothing. ptxas's spills show only
    in the cubin's stack size (cuobjdump), never as ld.local in the PTX: the per-byte gathers over
    masked pages took 696 bytes of stack and 3.6x the planar history loop's SASS
    (bench/results/2026-12-03-cpu-triton-masked-read-sass). In a child process: under
    TRITON_INTERPRET=1 (CI) the kernel is an interpreter function."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert [g["masked"] for g in got] == [False, True], got
    assert not any(g["local"] or g["stack"] for g in got), got
