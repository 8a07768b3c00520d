"""What CI can check of the 8-bit integer Hopper decode without a GPU (the masked code layout it
reads is tested with its reference, kernels/layout/code_layout_ref): an offline sm_90 compile, the launch
plan and the dispatch. The numerical tests run on the GPU
(test_attention_gluon_int8.py, marker gpu)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from oscar_compile.kernels.attention import attention_dispatch as ad
from oscar_compile.kernels.gluon_compat import GLUON_IMPORT_ERROR

needs_gluon = pytest.mark.skipif(GLUON_IMPORT_ERROR is not None, reason=f"no Gluon: {GLUON_IMPORT_ERROR}")


def test_heads_per_program_and_plan(monkeypatch):
    from oscar_compile.kernels.attention.decode import attention_gluon_int8 as k8

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


def test_dispatch_takes_the_int8_kernel_for_masked_int2(monkeypatch):
    monkeypatch.setattr(ad, "gluon_device_problem", lambda index: None)
    assert ad.choose_attention_kernel(*_shapes(), 2, 128, 4)[0] == "gluon_int8"
    assert ad.choose_attention_kernel(*_shapes(H_q=128, H_kv=8), 2, 128, 4)[0] == "gluon_int8"  # GQA 16
    assert ad.choose_attention_kernel(*_shapes(), 4, 128, 4)[0] == "gluon"  # INT4: planar rows
    assert ad.choose_attention_kernel(*_shapes(D=64), 2, 64, 4)[0] == "gluon"  # head_dim 64: planar rows
    for name, refused in {"page 32": (*_shapes(P=32), 2, 128, 4),
                          "fp32 scales": (*_shapes(sdt=torch.float32), 2, 128, 4),
                          "prefill-like": (*_shapes(N=40), 2, 128, 4)}.items():
        assert ad.choose_attention_kernel(*refused)[0] != "gluon_int8", name


_COMPILE = """
import json, sys
from oscar_compile.kernels.attention.decode.attention_gluon_int8 import compile_offline
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
