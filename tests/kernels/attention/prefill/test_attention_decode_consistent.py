"""Decode-consistent prefill (kernels/attention/prefill/attention_decode_consistent_ref.py) against decode steps.

The claim: a chunk's rows equal what one-token steps (``attention_ref`` then ``cache_write_ref``,
the decode path) give at the same positions, whatever the chunking, from standard rings and from
the states after prefix-cache hits past the sink. float32 queries and windows: the two differ only
by the float summation order over each row's keys (tolerance 1e-5 relative).
"""

import copy

import pytest
import torch

from oscar_compile.kernels.attention.decode.attention_ref import attention_ref
from oscar_compile.kernels.attention.prefill.attention_decode_consistent_ref import attention_decode_consistent_ref
from oscar_compile.kernels.cache_write.cache_write_ref import cache_write_ref
from oscar_compile.kernels.testing import build_case, random_kv

LENS = [0, 20, 70, 5, 48]
NEW = [50, 3, 45, 1, 0]
H_Q, H_KV, D = 4, 2, 64


def _new_tokens(seed: int):
    gen = torch.Generator().manual_seed(seed)
    n = sum(NEW)
    return (
        random_kv(n, H_Q, D, gen, torch.float32),
        random_kv(n, H_KV, D, gen, torch.float32),
        random_kv(n, H_KV, D, gen, torch.float32),
    )


def _case(bits: int, hits=None):
    return build_case(
        LENS,
        H_KV,
        D,
        sink=16,
        recent=32,
        bits=bits,
        group_size=32,
        window_dtype=torch.float32,
        extra_tokens=max(NEW),
        seed=3,
        hits=hits,
    )


def _call(fn, case, q, k, v, lens):
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    args = (
        q,
        k,
        v,
        cu,
        case.cache_lens,
        case.window_table,
        case.quant_table,
        *case.pools,
        D**-0.5,
        case.sink,
        case.recent,
        case.bits,
        case.group_size,
    )
    extra = (case.clip_k, case.clip_v) if fn is attention_decode_consistent_ref else ()
    out = fn(*args, *extra, history_lens=case.history_lens)
    cache_write_ref(
        k,
        v,
        cu,
        case.cache_lens,
        case.window_table,
        case.quant_table,
        *case.pools,
        case.sink,
        case.recent,
        case.bits,
        case.group_size,
        case.clip_k,
        case.clip_v,
        history_lens=case.history_lens,
    )
    case.append(k, v, cu)
    return out


def _in_steps(fn, case, q, k, v, step: int) -> torch.Tensor:
    """Run the new tokens ``step`` per sequence and call; outputs in the packed order of NEW."""
    starts = torch.tensor([0] + NEW).cumsum(0).tolist()
    outs = [[] for _ in NEW]
    done = [0] * len(NEW)
    while any(d < n for d, n in zip(done, NEW, strict=True)):
        take = [min(step, n - d) for d, n in zip(done, NEW, strict=True)]
        idx = torch.tensor([starts[i] + done[i] + t for i in range(len(NEW)) for t in range(take[i])], dtype=torch.long)
        out = _call(fn, case, q[idx], k[idx], v[idx], take)
        offset = 0
        for i, n in enumerate(take):
            outs[i].append(out[offset : offset + n])
            offset += n
        done = [d + t for d, t in zip(done, take, strict=True)]
    return torch.cat([torch.cat(o) for o in outs if o])


@pytest.mark.parametrize("bits", [2, 4, 16])
@pytest.mark.parametrize("hits", [None, [0, 16, 64, 0, 48]])
def test_chunk_equals_decode_steps(bits, hits):
    q, k, v = _new_tokens(seed=bits)
    case = _case(bits, hits)
    decode = _in_steps(attention_ref, copy.deepcopy(case), q, k, v, step=1)
    whole = _in_steps(attention_decode_consistent_ref, copy.deepcopy(case), q, k, v, step=max(NEW))
    chunked = _in_steps(attention_decode_consistent_ref, copy.deepcopy(case), q, k, v, step=7)
    assert torch.allclose(whole, decode, rtol=1e-5, atol=1e-5)
    assert torch.allclose(chunked, decode, rtol=1e-5, atol=1e-5)


def test_prompt_exact_chunk_differs_from_decode_steps():
    """The test can fail: the prompt-exact op reads the chunk's old tokens in full precision."""
    q, k, v = _new_tokens(seed=0)
    case = _case(2)
    decode = _in_steps(attention_ref, copy.deepcopy(case), q, k, v, step=1)
    exact = _in_steps(attention_ref, copy.deepcopy(case), q, k, v, step=max(NEW))
    assert not torch.allclose(exact, decode, rtol=1e-3, atol=1e-3)


def test_one_token_rows_equal_the_attention_op():
    q, k, v = _new_tokens(seed=5)
    case = _case(2)
    lens = [1] * len(NEW)
    idx = torch.tensor([0, 50, 53, 98, 98], dtype=torch.long)[:4]
    lens[-1] = 0
    want = _call(attention_ref, copy.deepcopy(case), q[idx], k[idx], v[idx], lens)
    got = _call(attention_decode_consistent_ref, case, q[idx], k[idx], v[idx], lens)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


def test_deterministic_rows_do_not_depend_on_the_chunking():
    """Deterministic mode: a row's bits are the same whichever chunk it comes in, one token
    (a decode step) included, and close to the dense reference."""
    from oscar_compile.kernels.attention.prefill.attention_decode_consistent_ref import (
        _attend_by_row,
        _attend_by_row_invariant,
    )

    g = torch.Generator().manual_seed(7)
    H_q, H_kv, D, L, T = 6, 2, 64, 40, 150
    sink, recent, h = 8, 32, 10
    views = [torch.randn(L + T, H_kv, D, generator=g) for _ in range(4)]  # k exact, k hist, v exact, v hist
    q = torch.randn(T, H_q, D, generator=g)
    k_own, v_own = torch.randn(T, H_kv, D, generator=g), torch.randn(T, H_kv, D, generator=g)

    def rows(a: int, b: int, attend):
        return attend(q[a:b], k_own[a:b], v_own[a:b], *(x[: L + b] for x in views), L + a, h, sink, recent, 0.125)

    whole = rows(0, T, _attend_by_row_invariant)
    torch.testing.assert_close(whole, rows(0, T, _attend_by_row), rtol=1e-5, atol=1e-5)
    for a, b in [(0, 1), (5, 6), (17, 80), (100, T), (T - 1, T), (3, 40)]:
        assert torch.equal(rows(a, b, _attend_by_row_invariant), whole[a:b]), (a, b)
