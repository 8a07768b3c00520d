"""Deterministic mode of the Triton attention kernels: a sequence's rows have the same bits alone,
among 3 and among many sequences, in a decode step or beside another sequence's prefill chunk,
with page tables trimmed to the batch (as eager steps have them) or at full width (as the CUDA
graphs have them), and stay within the usual tolerance of the reference.

The history splits are shrunk to 32 tokens (16-token blocks), so the sequences of 100-200 tokens
have several splits, some of them empty: what the fixed plan and the in-order merge must keep
exact. Under the interpreter 8 sequences stand for "many"; on the GPU, 64.
"""

from __future__ import annotations

import pytest
import torch

from oscar_compile.kernels import determinism
from oscar_compile.kernels.attention.decode.attention_ref import attention_ref
from oscar_compile.kernels.testing import build_case, random_kv

# bitwise invariance of the kernel, not of the host's BLAS (tests/kernels/conftest.py)
pytestmark = pytest.mark.usefixtures("row_invariant_dot")

TOL = 1e-2
LENS = [150, 70, 9, 200, 48, 120, 31, 100]


def _rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture
def small_splits(monkeypatch):
    monkeypatch.setattr(determinism, "DETERMINISTIC_SPLIT_TOKENS", 32)


def _call(fn, case, rows, seqs: list[int], chunk: dict[int, int], full_width: bool):
    """fn over sequences ``seqs`` (their own tables), ``chunk[i]`` new tokens for sequence i (else
    one); rows[i]: that sequence's (q, k, v) rows. Returns {i: its output rows}."""
    lens = [chunk.get(i, 1) for i in seqs]
    q, k, v = (torch.cat([rows[i][j][: lens[n]] for n, i in enumerate(seqs)]) for j in range(3))
    dev = q.device
    cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
    idx = torch.tensor(seqs, device=dev)
    qt = case.quant_table[idx]
    if not full_width:  # eager steps trim the tables to the batch's longest history
        used = int((qt != 0).sum(1).max()) + 1
        qt = qt[:, :used].contiguous()
    hist = case.history_lens[idx] if case.history_lens is not None else None
    args = (
        q,
        k,
        v,
        cu,
        case.cache_lens[idx],
        case.window_table[idx].contiguous(),
        qt,
        *case.pools,
        q.shape[-1] ** -0.5,
        case.sink,
        case.recent,
        case.bits,
        case.group_size,
        hist,
    )
    out = fn(*args)
    want = attention_ref(*args)
    assert _rel_err(out, want) < TOL
    return {i: out[cu[n] : cu[n + 1]] for n, i in enumerate(seqs)}


@pytest.mark.parametrize("bits", [2, 16])
def test_triton_attention_rows_do_not_depend_on_the_batch(tdevice, small_splits, bits):
    from functools import partial

    from oscar_compile.kernels.attention.decode.attention_triton import attention_triton

    lens = LENS if tdevice == "cpu" else (LENS * 8)
    case = build_case(lens, 1, 64, 16, 16, 32, bits, 64, torch.float16, seed=3, extra_tokens=24, device=tdevice)
    gen = torch.Generator().manual_seed(4)
    rows = [tuple(random_kv(24, h, 64, gen, device=tdevice) for h in (4, 1, 1)) for _ in lens]
    fn = partial(attention_triton, block_n=16)
    everyone = list(range(len(lens)))
    with determinism.deterministic():
        alone = {i: _call(fn, case, rows, [i], {}, False)[i] for i in (0, 2, 3)}
        runs = [
            _call(fn, case, rows, [0, 1, 2], {}, False),
            _call(fn, case, rows, [3, 0, 2], {}, True),
            _call(fn, case, rows, everyone, {}, False),
            _call(fn, case, rows, everyone, {}, True),
            _call(fn, case, rows, [0, 1, 2, 3], {1: 20}, False),  # beside a prefill chunk
        ]
    for run in runs:
        for i, out in alone.items():
            if i in run:
                assert torch.equal(run[i], out), i


def test_bf16_paged_attention_rows_do_not_depend_on_the_batch(tdevice, small_splits):
    """The runtime's BF16 mode (oscar::attention_bf16): decode rows alone, among 3, among all,
    and beside a prefill chunk."""
    from functools import partial

    from oscar_compile.kernels import ops
    from oscar_compile.kernels.attention.attention_bf16_ref import attention_bf16_ref
    from oscar_compile.kernels.attention.attention_bf16_triton import attention_bf16_triton

    lens, P, D, H_kv, H_q = (LENS if tdevice == "cpu" else LENS * 8), 16, 64, 1, 4
    gen = torch.Generator().manual_seed(5)
    need = [-(-(L + 24) // P) for L in lens]
    table = torch.randperm(sum(need), generator=gen).to(torch.int32)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = table[at : at + n]
        at += n
    tables = tables.to(tdevice)
    k_pages = torch.zeros(sum(need), H_kv, P, D, dtype=torch.bfloat16, device=tdevice)
    v_pages = torch.zeros_like(k_pages)
    cu = torch.tensor([0] + lens, device=tdevice).cumsum(0).to(torch.int32)
    zeros = torch.zeros(len(lens), dtype=torch.int32, device=tdevice)
    kv = [random_kv(sum(lens), H_kv, D, gen, device=tdevice) for _ in range(2)]
    ops.cache_write_bf16(*kv, cu, zeros, tables, k_pages, v_pages)
    cache_lens = torch.tensor(lens, dtype=torch.int32, device=tdevice)
    rows = [tuple(random_kv(24, h, D, gen, device=tdevice) for h in (H_q, H_kv, H_kv)) for _ in lens]
    fn = partial(attention_bf16_triton, block_n=16)

    def call(seqs, chunk):
        n_new = [chunk.get(i, 1) for i in seqs]
        q, k, v = (torch.cat([rows[i][j][: n_new[n]] for n, i in enumerate(seqs)]) for j in range(3))
        c = torch.tensor([0] + n_new, device=tdevice).cumsum(0).to(torch.int32)
        idx = torch.tensor(seqs, device=tdevice)
        args = (q, k, v, c, cache_lens[idx], tables[idx].contiguous(), k_pages, v_pages, D**-0.5)
        out = fn(*args)
        assert _rel_err(out, attention_bf16_ref(*args)) < TOL
        return {i: out[c[n] : c[n + 1]] for n, i in enumerate(seqs)}

    with determinism.deterministic():
        alone = {i: call([i], {})[i] for i in (0, 2)}
        runs = [call([0, 1, 2], {}), call(list(range(len(lens))), {}), call([2, 1, 0], {1: 20})]
    for run in runs:
        for i, out in alone.items():
            assert torch.equal(run[i], out), i
