"""What CI can check of the 8-bit integer Hopper decode without a GPU: the masked code layout
(bitwise round trips, byte ownership, the A-fragment property the kernel relies on), an offline
sm_90 compile, the launch plan and the dispatch. The numerical tests run on the GPU
(test_attention_gluon_int8.py, marker gpu)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from oscar_compile import quant
from oscar_compile.kernels import attention_dispatch as ad
from oscar_compile.kernels import attention_gluon_int8_pack as pk
from oscar_compile.kernels.gluon_compat import GLUON_IMPORT_ERROR

needs_gluon = pytest.mark.skipif(GLUON_IMPORT_ERROR is not None, reason=f"no Gluon: {GLUON_IMPORT_ERROR}")


def _codes(seed=0, shape=(3, 2, 16, 128)):
    return torch.randint(0, 4, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def test_pack_round_trips_bitwise():
    c = _codes()
    assert torch.equal(pk.unpack_keys(pk.pack_keys(c)), c)
    assert torch.equal(pk.unpack_values(pk.pack_values(c)), c)
    planar = quant.pack_codes(c, 2)
    for keys in (True, False):
        masked = pk.masked_codes(planar, keys)
        assert masked.shape == planar.shape and not torch.equal(masked, planar)
        assert torch.equal(pk.planar_codes(masked, keys), planar)


def test_a_key_byte_belongs_to_4_tokens_of_one_quad_and_a_value_byte_to_one_token():
    """What makes one-token writes safe: a key byte is ORed by the 4 tokens 4q .. 4q + 3 of its
    page only; a value byte is owned by one token."""
    c = _codes(1, (16, 128))
    kbase, vbase = pk.pack_keys(c), pk.pack_values(c)
    for tok in (0, 6, 15):
        c2 = c.clone()
        c2[tok] = (c2[tok] + 1) % 4
        kdiff = (pk.pack_keys(c2) != kbase).nonzero().flatten().tolist()
        assert kdiff and all(128 * (tok // 4) <= d < 128 * (tok // 4 + 1) for d in kdiff)
        vdiff = set((pk.pack_values(c2) != vbase).nonzero().flatten().tolist())
        others = c.clone()
        others[[t for t in range(16) if t != tok]] += 1
        others %= 4
        assert vdiff and not vdiff & set((pk.pack_values(others) != vbase).nonzero().flatten().tolist())


def test_masking_a_word_gives_the_signed_code_times_4_to_the_j():
    """``byte & (3 << 2j)`` read as a signed byte is 4^j (c - 2 [j = 3]) of the code at the byte's
    (token, channel) for bit pair j: the A register the kernel feeds to the s8 wgmma."""
    c = _codes(2, (16, 128)).to(torch.int32)
    i = torch.arange(512)
    layouts = (  # (packed, token of bit pair j, channel of bit pair j)
        (pk.pack_keys(c), lambda j: 4 * (i // 128) + j,
         lambda j: 32 * (i // 8 % 4) + 16 * (i // 4 % 2) + 4 * (i // 32 % 4) + i % 4),
        (pk.pack_values(c), lambda j: 4 * (i // 4 % 4) + i % 4,
         lambda j: 16 * (i // 128) + i // 16 % 8 + 8 * (j & 1) + 64 * (j >> 1)),
    )
    for packed, token, channel in layouts:
        b = packed.to(torch.int32)
        for j in range(4):
            plane = b & (3 << (2 * j))
            signed = torch.where(plane >= 128, plane - 256, plane)
            want = c[token(j), channel(j)] - (2 if j == 3 else 0)
            assert torch.equal(signed, want * 4**j), j


def test_heads_per_program_and_plan(monkeypatch):
    from oscar_compile.kernels import attention_gluon_int8 as k8

    assert [k8.heads_per_program(g) for g in (1, 2, 3, 4, 5, 6, 8, 12, 16)] == [1, 2, 3, 4, 1, 3, 4, 4, 4]
    dev = torch.device("cpu")  # 4 SMs stand in: 16 slots
    assert k8.plan_int8_launch(1, 8, 4, 256, 64, 256, dev) == (1, 1)
    monkeypatch.setattr(k8, "num_sms", lambda device: 132)  # an H200: 528 slots
    assert k8.plan_int8_launch(1, 8, 4, 32768 - 320, 64, 256, dev) == (64, 2)  # windows within the wave
    assert k8.plan_int8_launch(1, 8, 4, 8192 - 320, 64, 256, dev) == (31, 6)
    assert k8.plan_int8_launch(32, 8, 4, 131072 - 320, 64, 256, dev)[1] == 1
    monkeypatch.undo()
    ns, nw = k8.plan_int8_launch(1, 2, 4, 131072, 64, 256, dev)
    assert ns * 2 >= 16 and -(-131072 // 128 // ns) >= 2 and nw >= 1
    # deterministic: the split count follows the table width only, the window programs nothing
    assert k8.plan_int8_launch(1, 8, 4, 8192, 64, 256, dev, True) == k8.plan_int8_launch(32, 8, 16, 8192, 64, 256,
                                                                                          dev, True)
    assert k8.plan_int8_launch(1, 8, 4, 8192, 64, 256, dev, True)[0] == 8192 // k8.DET_SPLIT_TOKENS


def _shapes(N=4, H_q=32, H_kv=8, D=128, P=16, sdt=torch.float16, wdt=torch.bfloat16):
    q = torch.empty(N, H_q, D, dtype=wdt)
    k = torch.empty(N, H_kv, D, dtype=wdt)
    k_win = torch.empty(2, H_kv, P, D, dtype=wdt)
    k_codes = torch.empty(2, H_kv, P, D // 4, dtype=torch.uint8)
    k_scale = torch.empty(2, H_kv, P, 1, dtype=sdt)
    return q, k, k_win, k_codes, k_scale


def test_dispatch_takes_the_int8_kernel_only_on_masked_pools(monkeypatch):
    monkeypatch.setattr(ad, "gluon_device_problem", lambda index: None)
    monkeypatch.delenv(ad.ENV, raising=False)
    call = (*_shapes(), 2, 128, 4)
    assert ad.choose_attention_kernel(*call)[0] == "gluon"  # planar pools: today's Gluon kernel
    monkeypatch.setattr(ad, "INT2_CODE_LAYOUT", "masked")
    assert ad.choose_attention_kernel(*call)[0] == "gluon_int8"
    assert ad.choose_attention_kernel(*_shapes(H_q=128, H_kv=8), 2, 128, 4)[0] == "gluon_int8"  # GQA 16
    assert ad.choose_attention_kernel(*_shapes(), 4, 128, 4)[0] == "gluon"  # INT4
    for name, refused in {"head_dim 64": (*_shapes(D=64), 2, 64, 4), "page 32": (*_shapes(P=32), 2, 128, 4),
                          "fp32 scales": (*_shapes(sdt=torch.float32), 2, 128, 4),
                          "prefill-like": (*_shapes(N=40), 2, 128, 4)}.items():
        assert ad.choose_attention_kernel(*refused)[0] != "gluon_int8", name


_COMPILE = """
import json, sys
from oscar_compile.kernels.attention_gluon_int8 import compile_offline
out = []
for g, has_hist, det in json.loads(sys.argv[1]):
    ck = compile_offline(num_q_per_kv=g, has_hist=has_hist, deterministic=det)
    ptx = ck.asm["ptx"]
    out.append({"wgmma": ptx.count("wgmma.mma_async"), "s8": ptx.count(".s32.s8.s8"), "shared": ck.metadata.shared})
print(json.dumps(out))
"""


@needs_gluon
def test_kernel_compiles_for_sm90_with_register_fragments():
    """The masked words become wgmma A operands with ``assert_trivial=True`` conversions: the
    compile fails if a layout is not the fragment. In a child process (no TRITON_INTERPRET)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    configs = [(4, False, False), (8, True, False), (1, False, True)]
    res = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(configs)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    for got in json.loads(res.stdout.strip().splitlines()[-1]):
        assert got["s8"] >= 5 and got["shared"] <= 227 * 1024  # 4 key dots + 1 value dot per step
