"""The extend path (dequantize the cache once, then the paged BF16 kernel) against its references.

- The dequantization kernel against cache_dequant_ref: bitwise on every cached row (the float32
  product s * (code - z) is the same, and both round it to the window dtype to nearest even).
- The reference's pages against the token streams that were written: window rows bitwise,
  history rows within the quantization error (checks the position order independently).
- The whole path against attention_ref, tolerance 1e-2 in relative Frobenius norm, as for the
  fused kernel (test_attention_triton.py): the history is rounded to the window dtype once
  (2^-9 relative in bf16), the softmax weights to bf16 for the value dots, the output to bf16;
  an indexing or masking error gives O(1).
- Which calls the dispatch sends there (shapes only).
"""
from __future__ import annotations

import pytest
import torch

from oscar_compile.kernels.attention import attention_dispatch as ad
from oscar_compile.kernels.attention.decode.attention_ref import attention_ref
from oscar_compile.kernels.layout.cache_dequant_ref import dequantize_cache_ref
from oscar_compile.kernels.testing import build_case, random_kv

TOL = 1e-2
P = 16

# cache lens, prefix hits, sink, recent, H_kv, D, bits, G, window dtype: ragged lengths with an
# empty cache, shorter than S0 + W, on a page boundary (48 = S0 + W) and long; after prefix hits
# (history_lens past the standard, a ring wrapping, one shorter than the sink); groups below D;
# INT4; no ring; no windows
DEQUANT_CASES = [
    ([0, 9, 48, 150], None, 16, 32, 2, 64, 2, 64, torch.bfloat16),
    ([70, 64, 84, 61, 5], [0, 64, 64, 48, 0], 16, 32, 2, 128, 2, 32, torch.bfloat16),
    ([33, 120], None, 16, 16, 1, 128, 4, 32, torch.float16),
    ([40, 100], None, 16, 0, 2, 64, 2, 16, torch.float32),
    ([40, 97], None, 0, 0, 1, 64, 2, 64, torch.bfloat16),
]


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _case(lens, hits, sink, recent, H_kv, D, bits, G, wdt, device, extra=40):
    return build_case(lens, H_kv, D, P, sink, recent, bits, G, torch.float16, window_dtype=wdt,
                      seed=len(lens) + D + bits, extra_tokens=extra, hits=hits, device=device)


def _dequant_args(case):
    return (case.cache_lens, case.window_table, case.quant_table, *case.pools, case.sink,
            case.recent, case.bits, case.group_size, case.history_lens)


@pytest.mark.parametrize("lens,hits,sink,recent,H_kv,D,bits,G,wdt", DEQUANT_CASES)
def test_dequantize_is_the_reference_bitwise(tdevice, lens, hits, sink, recent, H_kv, D, bits, G, wdt):
    from oscar_compile.kernels.layout.cache_dequant_triton import dequantize_cache_triton

    case = _case(lens, hits, sink, recent, H_kv, D, bits, G, wdt, tdevice)
    want = dequantize_cache_ref(*_dequant_args(case))
    got = dequantize_cache_triton(*_dequant_args(case))
    assert torch.equal(got[2], want[2])
    # the same rows when the runs of pages differ: the first sequence not decoded (an empty run),
    # the others with just the pages their tokens need, packed
    need = [0] + [-(-L // P) for L in lens[1:]]
    runs = torch.tensor([0] + need, dtype=torch.int32).cumsum(0).to(device=tdevice, dtype=torch.int32)
    moved = dequantize_cache_triton(*_dequant_args(case), page_runs=runs, num_pages=int(runs[-1]) + 1)
    assert torch.equal(moved[2][:, 0], runs[:-1])
    for i, L in enumerate(lens):
        pos = torch.arange(L, device=tdevice)
        page, row = want[2][i, pos // P].long(), pos % P
        for out in (got, moved) if i else (got,):
            page_got = out[2][i, pos // P].long()
            for g, w in zip(out[:2], want[:2], strict=True):
                assert torch.equal(g[page_got, :, row], w[page, :, row]), (i, L)


@pytest.mark.parametrize("lens,hits,sink,recent,H_kv,D,bits,G,wdt", DEQUANT_CASES[:3])
def test_reference_pages_hold_the_written_tokens_in_order(lens, hits, sink, recent, H_kv, D, bits, G, wdt):
    """Sink and ring positions as written (bitwise), history positions within the INT-b error."""
    case = _case(lens, hits, sink, recent, H_kv, D, bits, G, wdt, "cpu")
    k_pages, v_pages, table = dequantize_cache_ref(*_dequant_args(case))
    hists = case.history_lens.tolist() if case.history_lens is not None else [
        max(0, L - sink - recent) for L in lens]
    for i, (L, h) in enumerate(zip(lens, hists, strict=True)):
        pos = torch.arange(L)
        hist = (pos >= sink) & (pos < sink + h)
        for pages, stream in ((k_pages, case.keys[i]), (v_pages, case.values[i])):
            rows = pages[table[i, pos // P].long(), :, pos % P]
            assert torch.equal(rows[~hist], stream[~hist])
            if hist.any():  # clipped at rho 0.96 / 0.92 and 2 or 4 bits: 0.3-0.62 on these
                # streams, where the row of a neighbouring token gives 1.2-1.3
                assert rel_err(rows[hist], stream[hist]) < 0.8


EXTEND_CASES = [  # sink, recent, H_q, H_kv, D, bits, G: GQA 2 / 4 / 8 and 1, D 64 / 128, G < D
    (16, 32, 4, 2, 64, 2, 64),
    (16, 32, 8, 1, 128, 2, 32),
    (0, 16, 2, 2, 64, 4, 32),
    (32, 16, 8, 2, 128, 2, 128),
]


def run_both(case, chunk_lens, H_q, device, seed):
    from oscar_compile.kernels.attention.prefill.attention_extend_triton import (
        attention_extend_triton,
        extend_unsupported_reason,
    )

    gen = torch.Generator().manual_seed(seed)
    H_kv, D = case.pools.k_win.shape[1], case.pools.k_win.shape[3]
    n = sum(chunk_lens)
    q, k, v = (random_kv(n, h, D, gen, device=device) for h in (H_q, H_kv, H_kv))
    cu = torch.tensor([0] + chunk_lens, device=device).cumsum(0).to(torch.int32)
    args = (q, k, v, cu, case.cache_lens, case.window_table, case.quant_table, *case.pools,
            D ** -0.5, case.sink, case.recent, case.bits, case.group_size, case.history_lens)
    assert extend_unsupported_reason(q, k, case.window_table, case.quant_table, case.pools.k_win,
                                     case.bits, len(chunk_lens), case.group_size) is None
    return attention_extend_triton(*args), attention_ref(*args)


@pytest.mark.parametrize("sink,recent,H_q,H_kv,D,bits,G", EXTEND_CASES)
def test_extend_matches_reference(tdevice, sink, recent, H_q, H_kv, D, bits, G):
    """Ragged chunks (one empty) over an empty cache, one shorter than S0 + W, one on a page
    boundary and a long one; chunks longer than a 64-key block of the chunk loop."""
    case = build_case([0, 21, 48, 150], H_kv, D, P, sink, recent, bits, G, torch.float16, seed=2,
                      extra_tokens=70, device=tdevice)
    got, want = run_both(case, [37, 0, 3, 70], H_q, tdevice, seed=3)
    assert got.dtype == want.dtype and rel_err(got, want) < TOL


def test_extend_after_prefix_hits_matches_reference(tdevice):
    """history_lens past the standard (ring refilling, one wrapping, stale ring slots)."""
    case = build_case([70, 64, 84, 61, 5], 2, 64, P, 16, 32, 2, 32, torch.float16, seed=6,
                      extra_tokens=40, hits=[0, 64, 64, 48, 0], device=tdevice)
    got, want = run_both(case, [3, 34, 1, 2, 20], 8, tdevice, seed=7)
    assert rel_err(got, want) < TOL


def test_scratch_plan_takes_the_chunks_that_fit_in_batch_order():
    """Sequences of >= 3 new tokens get ceil(L / P) pages each, in order, while they fit; decode
    rows and empty chunks none (shapes: the prefix sums run on the device)."""
    from oscar_compile.kernels.attention.prefill.attention_extend_triton import plan_scratch

    cu = torch.tensor([0, 1, 38, 40, 60, 60, 70], dtype=torch.int32)  # 1, 37, 2, 20, 0, 10 new
    lens = torch.tensor([100, 50, 200, 30, 0, 17], dtype=torch.int32)  # 7, 4, 13, 2, 0, 2 pages
    runs, decoded = plan_scratch(cu, lens, P, 64)
    assert runs.tolist() == [0, 0, 4, 4, 6, 6, 8] and decoded.tolist() == [False, True, False, True, False, True]
    runs, decoded = plan_scratch(cu, lens, P, 7)  # the third run no longer fits
    assert runs.tolist() == [0, 0, 4, 4, 6, 6, 6] and runs.dtype == torch.int32
    assert decoded.tolist() == [False, True, False, True, False, False]


@pytest.mark.parametrize("mode", ["per_sequence", "small_cap", "whole_call"])
def test_mixed_step_matches_reference(tdevice, monkeypatch, mode):
    """Decode rows, an empty chunk and long chunks in one prefill-like call: per sequence (the
    decode rows on the fused kernel, the chunks on the scratch, one output), with a cap that
    holds only the first chunk's pages (the later chunk runs fused too), and as one whole call."""
    import oscar_compile.kernels.attention.prefill.attention_extend_triton as ext

    planned = []
    plan = ext.plan_scratch
    monkeypatch.setattr(ext, "plan_scratch", lambda *a: planned.append(plan(*a)) or planned[-1])
    if mode == "small_cap":  # 150 + 100 cached: 10 + 7 pages; room for 12
        monkeypatch.setattr(ext, "MAX_SCRATCH_BYTES", 12 * 2 * 2 * P * 64 * 2)
    if mode == "whole_call":
        monkeypatch.setattr(ext, "per_sequence_mode", lambda *a: False)
    case = build_case([30, 150, 48, 100, 21, 0], 2, 64, P, 16, 32, 2, 32, torch.float16, seed=30,
                      extra_tokens=40, hits=[0, 80, 0, 0, 0, 0], device=tdevice)
    got, want = run_both(case, [1, 37, 2, 20, 0, 5], 8, tdevice, seed=31)
    assert rel_err(got, want) < TOL
    decoded = {"per_sequence": [False, True, False, True, False, True],
               "small_cap": [False, True, False, False, False, False]}
    assert [d.tolist() for _, d in planned] == ([decoded[mode]] if mode in decoded else [])


def _shapes(N, B=4, H_q=32, H_kv=8, D=128, qcols=8):
    q = torch.empty(N, H_q, D, dtype=torch.bfloat16)
    k = torch.empty(N, H_kv, D, dtype=torch.bfloat16)
    k_win = torch.empty(2, H_kv, P, D, dtype=torch.bfloat16)
    k_codes = torch.empty(2, H_kv, P, D // 4, dtype=torch.uint8)
    k_scale = torch.empty(2, H_kv, P, 1, dtype=torch.float16)
    wt = torch.zeros(B, 20, dtype=torch.int32)
    qt = torch.zeros(B, qcols, dtype=torch.int32)
    return q, k, k_win, k_codes, k_scale, wt, qt


def _choose(q, k, k_win, k_codes, k_scale, wt, qt, bits=2, B=4, forced="auto"):
    return ad.choose_attention_kernel(q, k, k_win, k_codes, k_scale, bits, 128, B, wt, qt, forced=forced)


def test_dispatch_sends_prefill_like_int_b_calls_to_the_extend_path(monkeypatch):
    """Shapes only: prefill-like INT2 / INT4 calls with history pages and a scratch under the
    cap; decode-like INT4 calls stay on Gluon (INT2 at head_dim 128 is masked: the 8-bit integer
    Gluon kernel on sm_90, Triton elsewhere), 16-bit
    layers and oversized calls on the fused kernel,
    on any GPU; ``OSCAR_ATTENTION_KERNEL=triton`` keeps the fused kernel everywhere."""
    import oscar_compile.kernels.attention.prefill.attention_extend_triton as ext

    for problem in (None, "compute capability 8.0"):
        monkeypatch.setattr(ad, "gluon_device_problem", lambda index, problem=problem: problem)
        assert _choose(*_shapes(N=40))[0] == "extend"
        assert _choose(*_shapes(N=40), bits=4)[0] == "extend"
        assert _choose(*_shapes(N=8), bits=4)[0] == ("gluon" if problem is None else "triton")
        # INT2 at head_dim 128 is masked (cache format version 2): the 8-bit integer kernel's
        assert _choose(*_shapes(N=8))[0] == ("gluon_int8" if problem is None else "triton")
        assert _choose(*_shapes(N=40), bits=16)[0] == "triton"
        assert _choose(*_shapes(N=40, qcols=0))[0] == "triton"
        assert _choose(*_shapes(N=40, D=96))[0] == "triton"
        # without the tables (an older caller) the extend path is not considered
        assert ad.choose_attention_kernel(*_shapes(N=40)[:5], 2, 128, 4)[0] == "triton"
    q, k, k_win, k_codes, k_scale, wt, qt = _shapes(N=40)
    need = ext.scratch_bytes(4, wt, qt, k_win)
    assert need == 2 * 4 * 32 * 8 * P * 128 * 2  # 20 + 8 table columns, rounded up to 32
    monkeypatch.setattr(ext, "MAX_SCRATCH_BYTES", need - 1)
    assert _choose(q, k, k_win, k_codes, k_scale, wt, qt)[0] == "extend"  # per sequence: what fits
    monkeypatch.setattr(ext, "plan_launch", lambda *a, **kw: (16, 64, 2))  # a split plan: whole call
    assert _choose(q, k, k_win, k_codes, k_scale, wt, qt)[0] == "triton"
    monkeypatch.setattr(ext, "MAX_SCRATCH_BYTES", need)
    assert _choose(q, k, k_win, k_codes, k_scale, wt, qt)[0] == "extend"
    assert _choose(q, k, k_win, k_codes, k_scale, wt, qt, forced="triton")[0] == "triton"


def test_extend_path_refuses_what_the_dispatch_would_not_send():
    from oscar_compile.kernels.attention.prefill.attention_extend_triton import attention_extend_triton

    case = build_case([40, 20], 1, 64, P, 16, 16, 16, 64, torch.float16, seed=1, extra_tokens=8)
    q, k = random_kv(6, 2, 64, torch.Generator()), random_kv(6, 1, 64, torch.Generator())
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="bits 16"):
        attention_extend_triton(q, k, k, cu, case.cache_lens, case.window_table, case.quant_table,
                                *case.pools, 0.125, 16, 16, 16, 64)


_COMPILE = """
import json, sys
from oscar_compile.kernels.layout.cache_dequant_triton import compile_offline
out = []
for wdt, sdt, bits, group, head_dim, has_hist in json.loads(sys.argv[1]):
    ptx = compile_offline(wdt, sdt, bits, group, head_dim, has_hist).asm["ptx"]
    out.append({"local": ("ld.local" in ptx) or ("st.local" in ptx), "stores": ptx.count("st.global")})
print(json.dumps(out))
"""


def test_dequant_kernel_compiles_for_sm90():
    """An offline sm_90 compile (not the interpreter's run): bf16 / fp16 / fp32 windows, INT2 and
    INT4, groups below D, no register spills. In a child process: under TRITON_INTERPRET=1 (CI)
    the kernel is an interpreter function."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    configs = [("bf16", "fp16", 2, 128, 128, True), ("bf16", "fp16", 4, 32, 128, False),
               ("fp16", "bf16", 2, 64, 64, False), ("fp32", "fp32", 2, 16, 64, True)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(configs)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert all(not g["local"] and g["stores"] > 0 for g in got), got


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_op_takes_the_extend_path_on_cuda():
    """``oscar::attention`` on a GPU: a prefill-like INT2 call after prefix hits runs the extend
    path (kernels_in_use says so) and matches the reference; forced to the fused kernel, too."""
    from oscar_compile.kernels import ops

    case = build_case([300, 90, 20], 2, 128, P, 16, 32, 2, 64, torch.float16, seed=21,
                      extra_tokens=70, hits=[0, 80, 0], device="cuda")
    gen = torch.Generator().manual_seed(22)
    q, k, v = (random_kv(100, h, 128, gen, device="cuda") for h in (8, 2, 2))
    cu = torch.tensor([0, 70, 90, 100], dtype=torch.int32, device="cuda")
    args = (q, k, v, cu, case.cache_lens, case.window_table, case.quant_table, *case.pools,
            128 ** -0.5, 16, 32, 2, 64, case.history_lens)
    want = attention_ref(*args)
    dispatch = ad.AttentionDispatch("auto", usage=ad.KernelUsage())
    with dispatch.step():
        assert rel_err(ops.attention(*args), want) < TOL
    assert "extend" in dispatch.usage.snapshot()
    with ad.AttentionDispatch("triton").step():
        assert rel_err(ops.attention(*args), want) < TOL
