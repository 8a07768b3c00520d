"""The Gluon Hopper decode kernel against attention_ref (GPU, sm_90 only: Gluon has no interpreter).

The same cases as the Triton kernel's tests (test_attention_triton.py): ragged lengths, page
boundaries, an empty INT2 segment, contexts shorter than sink + recent, GQA 1 / 4 / 8, head_dim
64 and 128, INT2 and INT4, forced history and window splits, prefix-cache hits, two-token chunks. Tolerance:
relative Frobenius error 1e-2, for the reason given there (bf16 output, fp16 p * scale and bf16
softmax weights in the dots); an indexing or masking error gives O(1).
"""
from __future__ import annotations

import pytest
import torch

from oscar_compile.formats.cache import code_layout
from oscar_compile.kernels.attention.decode.attention_gluon import CODE_LAYOUTS_READ
from oscar_compile.kernels.attention.decode.attention_ref import attention_ref
from oscar_compile.kernels.testing import build_case, random_kv

pytestmark = pytest.mark.gpu
TOL = 1e-2


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="the Gluon kernel needs an sm_90 GPU")


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_both(case, chunk_lens, H_q, seed=0, **kw):
    from oscar_compile.kernels.attention.decode.attention_gluon import attention_gluon

    gen = torch.Generator().manual_seed(seed)
    H_kv, D = case.pools.k_win.shape[1], case.pools.k_win.shape[3]
    n = sum(chunk_lens)
    q, k, v = (random_kv(n, h, D, gen, device="cuda") for h in (H_q, H_kv, H_kv))
    cu = torch.tensor([0] + chunk_lens, device="cuda").cumsum(0).to(torch.int32)
    args = (q, k, v, cu, case.cache_lens, case.window_table, case.quant_table, *case.pools,
            D ** -0.5, case.sink, case.recent, case.bits, case.group_size, case.history_lens)
    if code_layout(case.bits, D, case.pools.k_win.shape[2]) not in CODE_LAYOUTS_READ:
        with pytest.raises(ValueError, match="masked"):
            attention_gluon(*args, **kw)
        pytest.skip("masked INT2 pages (cache format version 2): this kernel refuses them (checked above)")
    got = attention_gluon(*args, **kw)
    torch.cuda.synchronize()
    return got, attention_ref(*args)


CASES = [  # sink, recent, H_q, H_kv, D, scale dtype
    (16, 32, 4, 2, 64, torch.float16),  # GQA 2, D = 64 (two warps per byte column)
    (0, 0, 2, 2, 64, torch.bfloat16),  # GQA 1, no windows at all
    (16, 0, 8, 1, 128, torch.float32),  # GQA 8, no recent window
    (32, 16, 4, 1, 128, torch.float16),  # GQA 4
    (64, 256, 32, 8, 128, torch.float16),  # the Qwen3-8B layer of the benchmark
    (16, 32, 16, 1, 64, torch.float16),  # N = 16 query heads per KV head
]
LENS = [0, 9, 48, 150, 1000, 333]  # empty, < sink + recent, a page boundary, 1 and 15 tiles, ragged


@needs_sm90
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("sink,recent,H_q,H_kv,D,sdt", CASES)
def test_decode_matches_reference(sink, recent, H_q, H_kv, D, sdt, bits):
    case = build_case(LENS, H_kv, D, 16, sink, recent, bits, D, sdt, seed=1, extra_tokens=4, device="cuda")
    got, want = run_both(case, [1] * len(LENS), H_q)
    assert got.dtype == want.dtype and torch.isfinite(got).all() and rel_err(got, want) < TOL


@needs_sm90
@pytest.mark.parametrize("nsplit,win_splits,bits", [(1, 1, 2), (3, 2, 2), (7, 3, 2), (40, 6, 2), (7, 3, 4)])
def test_forced_splits_match_reference(nsplit, win_splits, bits):
    """History in 1 / 3 / 7 / 40 splits (40: most of them empty), windows shared by several
    programs (6 > the window tiles: some get none); the last window program takes the chunk."""
    case = build_case([700, 70, 20, 1300], 2, 128, 16, 16, 128, bits, 128, torch.float16, seed=2,
                      extra_tokens=2, device="cuda")
    got, want = run_both(case, [1, 2, 1, 1], 8, seed=3, nsplit=nsplit, win_splits=win_splits)
    assert rel_err(got, want) < TOL


@needs_sm90
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("D,nsplit", [(64, None), (128, None), (128, 7)])
def test_pipeline_depths_match_reference(stages, D, nsplit):
    """Pipeline depths other than the default (the benchmark sweeps them), with the planned and
    with forced splits (7 splits of short histories: empty and one-tile parts)."""
    case = build_case(LENS, 2, D, 16, 16, 32, 2, D, torch.float16, seed=10, extra_tokens=2, device="cuda")
    got, want = run_both(case, [1] * len(LENS), 8, seed=11, stages=stages, nsplit=nsplit)
    assert rel_err(got, want) < TOL


@needs_sm90
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("chunk_lens", [[1] * 5, [2, 1, 2, 2, 1]])
def test_after_prefix_hits_matches_reference(D, chunk_lens, bits):
    """history_lens past the standard (rows [0, h) shared, ring refilling, stale ring slots)."""
    hits, lens = [0, 64, 64, 48, 0], [70, 64, 84, 61, 5]
    case = build_case(lens, 2, D, bits=bits, group_size=D, seed=6, extra_tokens=4, hits=hits, device="cuda")
    got, want = run_both(case, chunk_lens, 8, seed=7)
    assert rel_err(got, want) < TOL


@needs_sm90
@pytest.mark.parametrize("page_size,bits", [(16, 2), (32, 2), (64, 2), (32, 4)])
def test_page_sizes_and_empty_history(page_size, bits):
    """Pages of 16 / 32 / 64 tokens (a 64-token tile spans 4, 2 or 1 of them); one sequence with
    no quantized history at all beside long ones."""
    case = build_case([200, 40, 513], 2, 128, page_size, 64, 64, bits, 128, torch.float16, seed=8,
                      extra_tokens=2, device="cuda")
    assert case.cache_lens[1] < 128  # sequence 1: sink + recent only
    got, want = run_both(case, [1, 1, 1], 8, seed=9)
    assert rel_err(got, want) < TOL


@needs_sm90
def test_large_values_keep_the_softmax_finite():
    """Scores far from 0 (keys 30x larger): the running max must move across tiles correctly."""
    case = build_case([900, 300], 1, 128, 16, 16, 32, 4, 128, torch.float16, seed=10,
                      extra_tokens=2, device="cuda")  # INT4: INT2 at head_dim 128 is masked
    gen = torch.Generator().manual_seed(11)
    q = random_kv(2, 4, 128, gen, device="cuda") * 30
    k, v = random_kv(2, 1, 128, gen, device="cuda"), random_kv(2, 1, 128, gen, device="cuda")
    from oscar_compile.kernels.attention.decode.attention_gluon import attention_gluon

    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    args = (q, k, v, cu, case.cache_lens, case.window_table, case.quant_table, *case.pools,
            128 ** -0.5, case.sink, case.recent, 4, 128)
    got = attention_gluon(*args)
    assert torch.isfinite(got).all() and rel_err(got, attention_ref(*args)) < TOL


@needs_sm90
def test_dispatch_runs_gluon_for_decode_and_extend_for_prefill():
    """The op on an H200: decode goes to Gluon, a prefill chunk to the extend path (dequantize
    once, paged BF16 kernel); forcing Gluon or Triton works. INT4: INT2 at head_dim 128 is masked
    (cache format version 2) and runs the Triton kernel until issue #32's decode lands."""
    from oscar_compile.kernels import ops
    from oscar_compile.kernels.attention import attention_dispatch as ad

    case = build_case([300, 90], 2, 128, 16, 16, 32, 4, 128, torch.float16, seed=12,
                      extra_tokens=40, device="cuda")
    gen = torch.Generator().manual_seed(13)
    usage = ad.KernelUsage()
    for chunk_lens, expected in (([1, 1], "gluon"), ([37, 3], "extend")):
        n = sum(chunk_lens)
        q, k, v = (random_kv(n, h, 128, gen, device="cuda") for h in (8, 2, 2))
        cu = torch.tensor([0] + chunk_lens, device="cuda").cumsum(0).to(torch.int32)
        args = (q, k, v, cu, case.cache_lens, case.window_table, case.quant_table, *case.pools,
                128 ** -0.5, 16, 32, 4, 128)
        assert ad.choose_attention_kernel(q, k, case.pools.k_win, case.pools.k_codes,
                                          case.pools.k_scale, 4, 128, 2, case.window_table,
                                          case.quant_table)[0] == expected
        want = attention_ref(*args)
        for forced in ("auto", "gluon", "triton"):
            with ad.AttentionDispatch(forced, usage=usage).step():
                assert rel_err(ops.attention(*args), want) < TOL
    assert set(usage.snapshot()) == {"gluon", "extend", "triton"}


@needs_sm90
def test_cuda_graph_replay_follows_new_lengths():
    """Grid and plan come from shapes only: a captured launch replayed after the cache grew
    (cache_lens and the pools changed in place) matches the reference at the new lengths."""
    from oscar_compile.kernels.attention.decode.attention_gluon import attention_gluon
    from oscar_compile.kernels.cache_write.cache_write_ref import cache_write_ref

    case = build_case([400, 100], 2, 128, 16, 16, 32, 4, 128, torch.float16, seed=14,
                      extra_tokens=80, device="cuda")  # INT4: INT2 at head_dim 128 is masked
    gen = torch.Generator().manual_seed(15)
    q, k, v = (random_kv(2, h, 128, gen, device="cuda") for h in (8, 2, 2))
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    args = (q, k, v, cu, case.cache_lens, case.window_table, case.quant_table, *case.pools,
            128 ** -0.5, 16, 32, 4, 128)
    attention_gluon(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_gluon(*args)
    more = 70
    kk, vv = (random_kv(2 * more, 2, 128, gen, device="cuda") for _ in range(2))
    step = torch.tensor([0, more, 2 * more], dtype=torch.int32, device="cuda")
    cache_write_ref(kk, vv, step, case.cache_lens, case.window_table, case.quant_table, *case.pools,
                    16, 32, 4, 128, case.clip_k, case.clip_v)
    case.cache_lens += more
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, attention_ref(*args)) < TOL
