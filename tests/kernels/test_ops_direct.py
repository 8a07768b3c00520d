"""``kernels.ops.direct``: the attention and cache-write ops' implementations, called without the
dispatcher, give what the ops give, and pick the implementation by the arguments' device."""
import types

import torch

from oscar_compile.formats.op_args import AttentionBf16Args, CacheWriteBf16Args
from oscar_compile.kernels import ops


def _bf16_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    H_q, H_kv, D, P = 4, 2, 16, 4
    new, lens = [3, 1, 5], [6, 0, 9]
    N, B = sum(new), len(new)
    table = torch.arange(B * 4, dtype=torch.int32).reshape(B, 4)
    pages = [torch.randn(B * 4, H_kv, P, D, generator=g) for _ in range(2)]
    q, k, v = (torch.randn(N, h, D, generator=g) for h in (H_q, H_kv, H_kv))
    cu = torch.tensor([0, *new]).cumsum(0).to(torch.int32)
    return q, k, v, cu, torch.tensor(lens, dtype=torch.int32), table, pages


def _step(attention, write):
    q, k, v, cu, lens, table, pages = _bf16_case()
    pools = tuple(p.clone() for p in pages)
    write(*CacheWriteBf16Args(k, v, cu, lens, table, *pools))
    return attention(*AttentionBf16Args(q, k, v, cu, lens, table, *pools, 0.25)), pools


def test_direct_calls_equal_the_ops():
    op_attention, op_write = torch.ops.oscar.attention_bf16.default, torch.ops.oscar.cache_write_bf16.default
    want, want_pools = _step(op_attention, op_write)
    got, pools = _step(ops.direct(op_attention), ops.direct(op_write))
    assert ops.direct(op_attention) is not op_attention
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(pools, want_pools, strict=True))


def test_direct_picks_by_device_and_leaves_other_ops_alone():
    calls = []
    call = ops._on_device(torch.ops.oscar.attention.default, lambda *a, **kw: calls.append("cuda"),
                          lambda *a, **kw: calls.append("default"))
    call(types.SimpleNamespace(is_cuda=True), 1)
    call(types.SimpleNamespace(is_cuda=False), 1)
    call(q=types.SimpleNamespace(is_cuda=True))
    assert calls == ["cuda", "default", "cuda"]
    assert ops.direct(torch.ops.oscar.rms_norm.default) is torch.ops.oscar.rms_norm.default
    assert set(ops._DIRECT) == {torch.ops.oscar.attention.default, torch.ops.oscar.cache_write.default,
                                torch.ops.oscar.attention_bf16.default, torch.ops.oscar.cache_write_bf16.default}
