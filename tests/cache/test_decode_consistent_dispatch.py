"""run_decode_consistent on its Triton path (the CUDA default; Triton's interpreter here) against
its reference path, on a mixed step: decode rows (one new token: ``oscar::attention``), chunks
(the Triton kernel) and an empty sequence, after prefix-cache hits. float32: outputs within 2e-5
(float summation order), and the pools after the write bitwise equal (the same op writes)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from oscar_compile.cache.contract import layer_input_names
from oscar_compile.cache.decode_consistent import run_decode_consistent, split_rows
from oscar_compile.formats.cache import LayerFormat
from oscar_compile.kernels.testing import build_case, random_kv

LENS = [0, 20, 70, 5, 48, 130]
NEW = [50, 1, 45, 1, 0, 1]
LAYER = LayerFormat(sink=16, recent=32, page_size=16, bits=2, group_size=32, scale_dtype="float16")


def _put(values, dtype):
    return torch.tensor(values, dtype=dtype)


def _step(case, q, k, v, use_triton: bool, parts=None, new=NEW, step_memo=None):
    cu = torch.tensor([0] + new).cumsum(0).to(torch.int32)
    named = dict(q=q, k=k, v=v, cu_seqlens=cu, cache_lens=case.cache_lens, window_table=case.window_table,
                 quant_table=case.quant_table, **case.pools._asdict(), write_cu=cu,
                 history_lens=case.history_lens)  # fmt: skip
    inputs = tuple(named[name] for name in layer_input_names(LAYER))
    out, empty = run_decode_consistent(inputs, LAYER, 64**-0.5, case.clip_k, case.clip_v, use_triton=use_triton,
                                       parts=parts, step_memo=step_memo)
    assert dict(zip(layer_input_names(LAYER), empty, strict=True))["q"].shape[0] == 0
    return out


def test_triton_path_equals_the_reference_path():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET is not set")
    case = build_case(LENS, 2, 64, 16, LAYER.sink, LAYER.recent, LAYER.bits, LAYER.group_size, torch.float16,
                      torch.float32, seed=4, extra_tokens=max(NEW), hits=[0, 16, 64, 0, 48, 100])  # fmt: skip
    gen = torch.Generator().manual_seed(6)
    q, k, v = (random_kv(sum(NEW), h, 64, gen, torch.float32) for h in (4, 2, 2))
    ref_case, triton_case, split_case = copy.deepcopy(case), copy.deepcopy(case), copy.deepcopy(case)
    want = _step(ref_case, q, k, v, use_triton=False)
    got = _step(triton_case, q, k, v, use_triton=True)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert all(torch.equal(a, b) for a, b in zip(triton_case.pools, ref_case.pools, strict=True))
    # the runner's split, made on the host once per step, gives the same bits as the one read back
    split = _step(split_case, q, k, v, use_triton=True, parts=split_rows(NEW, _put))
    assert torch.equal(split, got)


def test_a_split_into_runs_of_rows_equals_the_gathered_split():
    """Decode rows first, then the chunks (the scheduler's order): each kind is one run of rows,
    taken as a view instead of gathered; the same bits. So do two layers of a step sharing the
    kernel's step memo (the second reads the first's offsets)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET is not set")
    lens, new = [20, 5, 130, 0, 70, 48], [1, 1, 1, 0, 50, 45]
    case = build_case(lens, 2, 64, 16, LAYER.sink, LAYER.recent, LAYER.bits, LAYER.group_size, torch.float16,
                      torch.float32, seed=5, extra_tokens=max(new), hits=[16, 0, 100, 0, 64, 48])  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    q, k, v = (random_kv(sum(new), h, 64, gen, torch.float32) for h in (4, 2, 2))
    parts = split_rows(new, _put)
    assert [type(rows) for _, rows, _ in parts] == [slice, slice]
    gathered = [(d, torch.arange(rows.start, rows.stop), cu) for d, rows, cu in parts]
    outs = [_step(copy.deepcopy(case), q, k, v, use_triton=True, parts=p, new=new) for p in (parts, gathered)]
    assert torch.equal(*outs)
    memo = {}
    layers = [_step(copy.deepcopy(case), q, k, v, use_triton=True, parts=parts, new=new, step_memo=memo)
              for _ in range(2)]
    assert len(memo) == 2 and all(torch.equal(out, outs[0]) for out in layers)


def test_split_rows_from_host_counts():
    (decode, rows_d, cu_d), (chunk, rows_c, cu_c) = split_rows(NEW, _put)
    assert decode and not chunk
    assert rows_d.tolist() == [50, 96, 97] and cu_d.tolist() == [0, 0, 1, 1, 2, 2, 3]
    assert rows_c.tolist() == [*range(50), *range(51, 96)] and cu_c.tolist() == [0, 50, 50, 95, 95, 95, 95]
    assert [(d, r, c) for d, r, c in split_rows([1, 0, 1], _put)] == [(True, slice(0, 2), None)]  # no gather
    assert [(d, r, c) for d, r, c in split_rows([7, 3], _put)] == [(False, slice(0, 10), None)]
    assert split_rows([0, 0], _put) == []
    # a run of rows is a view: a mixed step's decode rows, then its chunk
    (_, rows_d, cu_d), (_, rows_c, cu_c) = split_rows([1, 1, 0, 1, 30], _put)
    assert rows_d == slice(0, 3) and cu_d.tolist() == [0, 1, 2, 2, 3, 3]
    assert rows_c == slice(3, 33) and cu_c.tolist() == [0, 0, 0, 0, 0, 30]
