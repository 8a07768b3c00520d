"""What CI can check of the Gluon Hopper kernel without a GPU: an offline sm_90 compile (layouts
that are the wgmma fragments, no spills), and the dispatch between it and the Triton kernel.
The numerical tests run on the GPU (test_attention_gluon.py, marker gpu)."""
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


CONFIGS = [(128, 4, False, 2), (64, 8, True, 2), (128, 1, False, 2), (128, 4, True, 4), (64, 16, False, 4)]
# head_dim, GQA ratio, history_lens, bits
_COMPILE = """
import json, sys
from oscar_compile.kernels.attention.decode.attention_gluon import compile_offline
out = []
for head_dim, g, has_hist, bits in json.loads(sys.argv[1]):
    ck = compile_offline(head_dim=head_dim, num_q_per_kv=g, has_hist=has_hist, bits=bits)
    ptx = ck.asm["ptx"]
    out.append({"wgmma": ptx.count("wgmma.mma_async"), "local": ("ld.local" in ptx) or ("st.local" in ptx),
                "shared": ck.metadata.shared})
print(json.dumps(out))
"""


@needs_gluon
def test_kernel_compiles_for_sm90_with_register_fragments():
    """The decoded codes are converted to the wgmma A operand with ``assert_trivial=True``: the
    compile fails if a layout is not the fragment (a shared-memory round trip would be needed).
    In a child process: under TRITON_INTERPRET=1 (CI) the kernels are interpreter functions."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(CONFIGS)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    for (head_dim, _, _, _), got in zip(CONFIGS, json.loads(res.stdout.strip().splitlines()[-1]), strict=True):
        # per history tile the key dot (D / 16 k-steps) and the value dot (D / 16 more)
        assert got["wgmma"] >= 2 * head_dim // 16
        assert not got["local"] and got["shared"] <= 227 * 1024


def _call_shapes(N=4, B=4, H_q=32, H_kv=8, D=128, P=16, wdt=torch.bfloat16):
    q = torch.empty(N, H_q, D, dtype=wdt)
    k = torch.empty(N, H_kv, D, dtype=wdt)
    k_win = torch.empty(2, H_kv, P, D, dtype=wdt)
    k_codes = torch.empty(2, H_kv, P, D // 4, dtype=torch.uint8)
    k_scale = torch.empty(2, H_kv, P, 1, dtype=torch.float16)
    return q, k, k_win, k_codes, k_scale


def test_dispatch_picks_gluon_only_for_what_it_takes(monkeypatch):
    """Shapes and dtypes only (CUDA-graph safe): decode-like batches with one scale group per
    token and 16-token pages go to Gluon on a capable device (INT2 at head_dim 128, masked, to the
    8-bit integer kernel; INT2 at head_dim 64 and INT4 to the fp16-operand one), everything else
    to Triton."""
    monkeypatch.setattr(ad, "gluon_device_problem", lambda index: None)
    q, k, k_win, k_codes, k_scale = _call_shapes()
    assert ad.choose_attention_kernel(q, k, k_win, k_codes, k_scale, 2, 128, 4)[0] == "gluon_int8"
    assert ad.choose_attention_kernel(*_call_shapes(D=64), 2, 64, 4) == ("gluon", "sm_90")
    assert ad.choose_attention_kernel(q, k, k_win, k_codes, k_scale, 4, 128, 4) == ("gluon", "sm_90")
    refused = {
        "bits 8": (q, k, k_win, k_codes, k_scale, 8, 128, 4),
        "group_size 64": (q, k, k_win, k_codes, k_scale, 2, 64, 4),
        "prefill-like": (*_call_shapes(N=40), 2, 128, 4),
        "page_size 8": (*_call_shapes(P=8), 2, 128, 4),
        "head_dim 96": (*_call_shapes(D=96), 2, 96, 4),
        "window dtype": (*_call_shapes(wdt=torch.float32), 2, 128, 4),
        "query heads": (*_call_shapes(H_q=64, H_kv=1), 4, 128, 4),  # (the INT2 kernel takes any group)
    }
    for name, call in refused.items():
        kernel, why = ad.choose_attention_kernel(*call)
        assert kernel == "triton" and why, name
    assert ad.choose_attention_kernel(q, k, k_win, k_codes, k_scale, 2, 128, 4, forced="triton")[0] == "triton"


def test_forcing_gluon_where_it_cannot_run_is_an_error(monkeypatch):
    monkeypatch.setattr(ad, "gluon_device_problem", lambda index: "compute capability 8.0")
    q, k, k_win, k_codes, k_scale = _call_shapes()
    assert ad.choose_attention_kernel(q, k, k_win, k_codes, k_scale, 2, 128, 4, forced="auto")[0] == "triton"
    with pytest.raises(RuntimeError, match="compute capability 8.0"):
        ad.choose_attention_kernel(q, k, k_win, k_codes, k_scale, 2, 128, 4, forced="gluon")
    monkeypatch.setenv(ad.ENV, "fastest")
    with pytest.raises(ValueError, match="auto, gluon, triton"):
        ad.attention_kernel_from_env()


def test_the_interpreter_never_gets_the_gluon_kernel(monkeypatch):
    """Under TRITON_INTERPRET=1 (CI) the device check refuses Gluon before any capability query."""
    ad.gluon_device_problem.cache_clear()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    try:
        problem = ad.gluon_device_problem(0)
    finally:
        ad.gluon_device_problem.cache_clear()
    assert problem is not None


def test_launch_plan_fills_whole_waves_and_ignores_table_width_for_short_caches(monkeypatch):
    """Shapes only; numbers for a 132-SM H200 at the default register cap (4 programs per SM)."""
    from oscar_compile.kernels.attention.decode import attention_gluon as ag

    monkeypatch.setattr(ag, "num_sms", lambda device: 132)
    slots = ag.programs_per_sm(ag.MAXNREG, 128, 8) * 132
    assert slots == 4 * 132

    def plan(B, max_hist):
        return ag.plan_gluon_launch(B, B, 8, 4, max_hist, 64, 256, None)

    for B, ctx in ((1, 8192), (8, 32768), (32, 8192), (1, 131072)):
        nsplit, nwin = plan(B, ctx)
        tiles = -(-ctx // 64)
        assert nsplit * B * 8 <= slots or nsplit >= -(-ctx // ag.MAX_SPLIT_TOKENS)  # one wave, or precision
        assert -(-tiles // nsplit) >= 2 and nwin >= 1  # at least two tiles per split
    assert plan(32, 8192)[0] == 2  # 256 (token, head) pairs: two splits fill the 528 slots
    assert plan(32, 131072)[0] % 2 == 0  # several waves for precision: whole ones
    # a graph step plans for the full table width, an eager one for the batch's longest: below
    # 256 tokens both get one split and one window program, so their outputs agree bitwise
    assert plan(8, 256) == plan(8, 64) == (1, 1)


def test_metrics_say_which_attention_kernel_ran(monkeypatch):
    from oscar_compile.runtime.server import metrics

    stats = {key: 0 for *_, key in metrics._SCALARS}
    stats.update({f"{kind}_{suffix}": 0 for *_, suffix in metrics._PAGES for kind in metrics.PAGE_KINDS})
    stats.update({f"fork_{kind}_pages_{how}": 0 for kind in ("window", "quant") for how in ("shared", "copied")})
    usage = ad.KernelUsage()
    usage.note("gluon", "sm_90")
    usage.note("triton", 'a "prefill-like" batch')
    monkeypatch.setattr(ad, "PROCESS_USAGE", usage)  # what the process's runners and default dispatch note in
    text = metrics.render_metrics(stats)
    assert '\noscar_attention_kernel_info{kernel="gluon",reason="sm_90"} 1.0\n' in text
    assert 'oscar_attention_kernel_info{kernel="triton",reason="a \\"prefill-like\\" batch"} 1.0' in text


def test_each_kernel_choice_is_logged_once(monkeypatch, caplog):
    usage = ad.KernelUsage()
    with caplog.at_level("INFO", logger=ad.__name__):
        for _ in range(3):  # a server alternating prefill chunks and 16-bit layers
            usage.note("triton", "a prefill-like batch")
            usage.note("triton", "bits 16")
    assert len(caplog.records) == 2
    assert usage.snapshot() == {"triton": "bits 16"}
    usage.clear()
    assert usage.snapshot() == {}
