"""The 8-bit integer Hopper decode kernel against attention_ref (GPU, sm_90 only: Gluon has no interpreter).

The cache is written by the reference writer in the masked layout (cache format version 2), which
the kernel and the reference both read. Cases: ragged lengths, page boundaries, an empty INT2 segment, contexts shorter
than sink + recent, GQA 1 / 2 / 4 / 8 / 16 (more than 4 heads: several head groups per KV head),
forced history and window splits, prefix-cache hits, two-token chunks, CUDA-graph replay, queries
and keys with outlier channels (``random_kv``), large scores, the deterministic mode. Tolerance:
relative Frobenius error 5e-3 (the kernel measured 4e-4 to 2.4e-3 against this reference; the
bf16 output rounding alone is ~1.7e-3 against fp64); an indexing or masking error gives O(1).
"""
from __future__ import annotations

import pytest
import torch

from oscar_compile.kernels.attention.decode.attention_ref import attention_ref
from oscar_compile.kernels.testing import build_case, random_kv

pytestmark = pytest.mark.gpu
TOL = 5e-3


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="the Gluon kernel needs an sm_90 GPU")


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def make_args(case, chunk_lens, H_q, seed=0, q_gain=1.0):
    gen = torch.Generator().manual_seed(seed)
    H_kv, D = case.pools.k_win.shape[1], case.pools.k_win.shape[3]
    n = sum(chunk_lens)
    q, k, v = (random_kv(n, h, D, gen, device="cuda") for h in (H_q, H_kv, H_kv))
    cu = torch.tensor([0] + chunk_lens, device="cuda").cumsum(0).to(torch.int32)
    return (q * q_gain, k, v, cu, case.cache_lens, case.window_table, case.quant_table, *case.pools,
            D ** -0.5, case.sink, case.recent, case.bits, case.group_size, case.history_lens)


def run_both(case, chunk_lens, H_q, seed=0, q_gain=1.0, **kw):
    from oscar_compile.kernels.attention.decode.attention_gluon_int8 import attention_gluon_int8

    args = make_args(case, chunk_lens, H_q, seed, q_gain)
    got = attention_gluon_int8(*args, **kw)
    torch.cuda.synchronize()
    return got, attention_ref(*args)


CASES = [  # sink, recent, H_q, H_kv
    (0, 0, 2, 2),  # GQA 1, no windows at all
    (16, 32, 4, 2),  # GQA 2
    (32, 16, 4, 1),  # GQA 4
    (16, 0, 8, 1),  # GQA 8 (two head groups), no recent window
    (16, 32, 16, 1),  # GQA 16 (four head groups)
    (64, 256, 32, 8),  # the Qwen3-8B layer of the benchmark
    (16, 32, 6, 2),  # GQA 3 (one group of 3 heads)
]
LENS = [0, 9, 48, 150, 1000, 333, 2100]  # empty, < sink + recent, a page boundary, ragged, several steps


@needs_sm90
@pytest.mark.parametrize("sink,recent,H_q,H_kv", CASES)
def test_decode_matches_reference(sink, recent, H_q, H_kv):
    case = build_case(LENS, H_kv, 128, 16, sink, recent, 2, 128, torch.float16, seed=1, extra_tokens=4,
                      device="cuda")
    got, want = run_both(case, [1] * len(LENS), H_q)
    assert got.dtype == want.dtype and torch.isfinite(got).all() and rel_err(got, want) < TOL


@needs_sm90
@pytest.mark.parametrize("nsplit,win_splits,early,pdl", [(1, 1, False, False), (3, 2, True, False),
                                                         (7, 3, False, True), (40, 6, True, True)])
def test_forced_splits_match_reference(nsplit, win_splits, early, pdl):
    """History in 1 / 3 / 7 / 40 splits (40: most of them empty), windows shared by several
    programs (6 > the window tiles: some get none); the last window program takes the chunk. The
    first step loaded before or after the query work; the merge launched as a dependent or not."""
    case = build_case([700, 70, 20, 1300], 2, 128, 16, 16, 128, 2, 128, torch.float16, seed=2,
                      extra_tokens=2, device="cuda")
    got, want = run_both(case, [1, 2, 1, 1], 8, seed=3, nsplit=nsplit, win_splits=win_splits, early_load=early,
                         pdl=pdl)
    assert rel_err(got, want) < TOL


@needs_sm90
@pytest.mark.parametrize("chunk_lens", [[1] * 5, [2, 1, 2, 2, 1]])
def test_after_prefix_hits_matches_reference(chunk_lens):
    """history_lens past the standard (rows [0, h) shared, ring refilling, stale ring slots)."""
    hits, lens = [0, 64, 64, 48, 0], [70, 64, 84, 61, 5]
    case = build_case(lens, 2, 128, seed=6, extra_tokens=4, hits=hits, device="cuda")
    got, want = run_both(case, chunk_lens, 8, seed=7)
    assert rel_err(got, want) < TOL


@needs_sm90
def test_empty_history_beside_long_ones_and_page_boundaries():
    """One sequence with no quantized history at all beside histories ending on and off page and
    step boundaries (16 / 128 tokens)."""
    case = build_case([200, 40, 513, 64 + 64 + 256, 64 + 65 + 128], 2, 128, 16, 64, 64, 2, 128, torch.float16,
                      seed=8, extra_tokens=2, device="cuda")
    got, want = run_both(case, [1] * 5, 8, seed=9)
    assert rel_err(got, want) < TOL


@needs_sm90
@pytest.mark.parametrize("q_gain", [0.02, 4.0])
def test_flat_and_peaked_attention(q_gain):
    """Nearly uniform attention over a long history (P' far below 1 everywhere) and peaked attention
    (the running maximum moves between steps)."""
    case = build_case([5000, 3000], 1, 128, 16, 16, 32, 2, 128, torch.float16, seed=16, extra_tokens=2,
                      device="cuda")
    got, want = run_both(case, [1, 1], 4, seed=17, q_gain=q_gain)
    assert torch.isfinite(got).all() and rel_err(got, want) < TOL


@needs_sm90
def test_large_values_keep_the_softmax_finite():
    """Scores far from 0 (queries 30x larger): the running max must move across steps correctly."""
    case = build_case([900, 300], 1, 128, 16, 16, 32, 2, 128, torch.float16, seed=10, extra_tokens=2,
                      device="cuda")
    got, want = run_both(case, [1, 1], 4, seed=11, q_gain=30.0)
    assert torch.isfinite(got).all() and rel_err(got, want) < TOL


@needs_sm90
def test_deterministic_mode_is_batch_invariant():
    """deterministic=True: fixed-size splits aligned to history position 0 and an in-order merge.
    A sequence's output is bitwise the same alone, in a batch with longer ones (more splits, most
    of them empty for it) and with a wider page table; and it matches the reference."""
    from oscar_compile.kernels.attention.decode.attention_gluon_int8 import attention_gluon_int8

    case = build_case([9000, 300, 20000], 2, 128, 16, 64, 256, 2, 128, torch.float16, seed=18, extra_tokens=2,
                      device="cuda")
    args = make_args(case, [1, 1, 1], 8, seed=19)
    batch = attention_gluon_int8(*args, deterministic=True)
    ref = attention_ref(*args)
    assert rel_err(batch, ref) < TOL
    q, k, v, cu = args[:4]
    one = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    for i in range(3):
        need = max(1, -(-(int(case.cache_lens[i]) - 320) // 16))  # the sequence's own pages only
        narrow = case.quant_table[i:i + 1, :need]
        for table in (case.quant_table[i:i + 1], narrow):
            alone = attention_gluon_int8(q[i:i + 1], k[i:i + 1], v[i:i + 1], one, case.cache_lens[i:i + 1],
                                         case.window_table[i:i + 1], table.contiguous(), *args[7:15], *args[15:20],
                                         None, deterministic=True)
            assert torch.equal(alone, batch[i:i + 1]), i


@needs_sm90
def test_dispatch_runs_the_int8_kernel_for_int2_decode():
    """INT2 decode at head_dim 128 goes to this kernel through the op."""
    from oscar_compile.kernels import ops
    from oscar_compile.kernels.attention import attention_dispatch as ad

    case = build_case([300, 90], 2, 128, 16, 16, 32, 2, 128, torch.float16, seed=12, extra_tokens=4,
                      device="cuda")
    args = make_args(case, [1, 1], 8, seed=13)
    q, k = args[0], args[1]
    kernel, _ = ad.choose_attention_kernel(q, k, args[7], args[9], args[10], 2, 128, 2, args[5], args[6])
    assert kernel == "gluon_int8"
    dispatch = ad.AttentionDispatch("auto", usage=ad.KernelUsage())  # (the other dispatch tests count what ran)
    with dispatch.step():
        assert rel_err(ops.attention(*args), attention_ref(*args)) < TOL
    assert "gluon_int8" in dispatch.usage.snapshot()


@needs_sm90
@pytest.mark.parametrize("pdl", [False, True])
def test_cuda_graph_replay_follows_new_lengths(pdl):
    """Grid and plan come from shapes only: a captured launch replayed after the cache grew
    (cache_lens and the pools changed in place) matches the reference at the new lengths."""
    from oscar_compile.kernels.attention.decode.attention_gluon_int8 import attention_gluon_int8
    from oscar_compile.kernels.cache_write.cache_write_ref import cache_write_ref

    case = build_case([400, 100], 2, 128, 16, 16, 32, 2, 128, torch.float16, seed=14, extra_tokens=300,
                      device="cuda")
    args = make_args(case, [1, 1], 8, seed=15)
    attention_gluon_int8(*args, pdl=pdl)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_gluon_int8(*args, pdl=pdl)
    gen = torch.Generator().manual_seed(16)
    more = 270
    kk, vv = (random_kv(2 * more, 2, 128, gen, device="cuda") for _ in range(2))
    step = torch.tensor([0, more, 2 * more], dtype=torch.int32, device="cuda")
    cache_write_ref(kk, vv, step, case.cache_lens, case.window_table, case.quant_table, *case.pools,
                    16, 32, 2, 128, case.clip_k, case.clip_v)
    case.cache_lens += more
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, attention_ref(*args)) < TOL
