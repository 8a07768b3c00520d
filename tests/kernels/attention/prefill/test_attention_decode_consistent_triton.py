"""Triton decode-consistent prefill against attention_decode_consistent_ref on small ragged batches.

Each case is a batch of chunks over stored caches: an empty cache whose chunk crosses the sink
and the recent window, short caches, caches with INT-b history (h > 0), an empty sequence, and
with ``hits`` the states after prefix-cache hits past the sink (h above the standard value).

Tolerances. float32 (queries, keys and windows): IEEE float32 dots, the reference up to the
summation order over a row's keys: 2e-5. bf16: relative Frobenius error 1e-2, as
test_attention_triton's (on a GPU the dots take bf16 operands: the history view's float32 values
and the softmax weights are rounded to bf16, 2^-9 each, and the output to bf16; under the
interpreter the dots run in float32 and the final cast truncates): a few 1e-3, while an indexing or
masking error (a key read from the wrong view, a position off by one) gives O(1) on some rows.
"""

from __future__ import annotations

import os

import pytest
import torch

from oscar_compile.kernels.attention.prefill.attention_decode_consistent_ref import attention_decode_consistent_ref
from oscar_compile.kernels.cache_write.cache_write_ref import cache_write_ref
from oscar_compile.kernels.testing import build_case, random_kv

LENS = [0, 20, 70, 5, 48, 130]
NEW = [50, 3, 45, 1, 0, 20]
HITS = [0, 16, 64, 0, 48, 100]

CASES = [  # H_q, H_kv, D, bits, G, window dtype, scale dtype, S0, W
    (2, 2, 64, 2, 32, torch.float32, torch.float16, 16, 32),  # planar INT2 (D 64), no GQA
    (4, 2, 128, 2, 64, torch.float32, torch.float16, 16, 32),  # masked INT2 (D 128), GQA 2
    (4, 1, 128, 4, 32, torch.float32, torch.bfloat16, 16, 16),  # INT4, GQA 4
    (4, 2, 64, 16, 64, torch.float32, torch.float16, 16, 32),  # a 16-bit layer beside INT-b ones
    (4, 2, 64, 2, 64, torch.float32, torch.float32, 0, 16),  # no sink
    (6, 2, 64, 2, 64, torch.float32, torch.float16, 16, 32),  # GQA 3: 21 tokens of 3 heads per program
    (4, 2, 64, 2, 64, torch.float32, torch.float16, 16, 0),  # no recent window
    (4, 1, 128, 2, 128, torch.bfloat16, torch.float16, 32, 16),
    (2, 2, 64, 4, 64, torch.bfloat16, torch.float16, 16, 32),
]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """The interpreter (TRITON_INTERPRET=1) on the CPU, or a CUDA device (marker ``gpu``)."""
    pytest.importorskip("triton")
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if request.param == "cuda":
        if interpreting or not torch.cuda.is_available():
            pytest.skip("needs a CUDA device and TRITON_INTERPRET unset")
    elif not interpreting:
        if os.environ.get("CI"):  # a CI run that skipped every kernel test would pass untested
            pytest.fail("CI: TRITON_INTERPRET is not set, so no kernel would run")
        pytest.skip("TRITON_INTERPRET is not set")
    return request.param


def _case(params, device, hits=None, extra_tokens=50):
    H_q, H_kv, D, bits, G, wdt, sdt, sink, recent = params
    return build_case(LENS, H_kv, D, 16, sink, recent, bits, G, sdt, wdt, seed=bits + D, hits=hits,
                      extra_tokens=extra_tokens, device=device)  # fmt: skip


def _tokens(params, new, device, seed=0, dtype=None):
    """q, k, v of the chunks ``new``, in the window dtype unless ``dtype`` says otherwise."""
    H_q, H_kv, D, *_, wdt = params[:6]
    gen = torch.Generator().manual_seed(seed)
    n = sum(new)
    return tuple(random_kv(n, h, D, gen, dtype or wdt, device) for h in (H_q, H_kv, H_kv))


def _both(case, q, k, v, new, **tiles):
    """(Triton, reference) outputs of one call on the chunks ``new`` (tokens per sequence)."""
    from oscar_compile.kernels.attention.prefill.attention_decode_consistent_triton import (
        attention_decode_consistent_triton,
    )

    D = q.shape[2]
    cu = torch.tensor([0] + new).cumsum(0).to(device=q.device, dtype=torch.int32)
    args = (q, k, v, cu, case.cache_lens, case.window_table, case.quant_table, *case.pools, D**-0.5, case.sink,
            case.recent, case.bits, case.group_size, case.clip_k, case.clip_v)  # fmt: skip
    got = attention_decode_consistent_triton(*args, history_lens=case.history_lens, **tiles)
    return got, attention_decode_consistent_ref(*args, history_lens=case.history_lens)


def _check(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    else:
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 1e-2, err


@pytest.mark.parametrize("params", CASES)
@pytest.mark.parametrize("hits", [None, HITS], ids=["standard", "hits"])
def test_matches_reference(device, params, hits):
    case = _case(params, device, hits)
    q, k, v = _tokens(params, NEW, device)
    _check(*_both(case, q, k, v, NEW))


@pytest.mark.parametrize("params", [CASES[1], CASES[7]])
def test_small_tiles_match_reference(device, params):
    """16 rows and 16 keys per tile: several blocks per sequence, boundaries spanning key blocks."""
    case = _case(params, device, HITS)
    q, k, v = _tokens(params, NEW, device, seed=1)
    _check(*_both(case, q, k, v, NEW, block_rows=16, block_n=16))


def test_own_token_as_passed(device):
    """float32 tokens over bf16 windows: a row's own key and value are read as passed, the chunk's
    older tokens rounded to bf16 (the views hold bf16 values: float32 dots stay exact, 2e-5)."""
    case = _case(CASES[7], device, HITS)
    q, k, v = _tokens(CASES[7], NEW, device, seed=2, dtype=torch.float32)
    _check(*_both(case, q, k, v, NEW))


@pytest.mark.parametrize("params", [CASES[0], CASES[2]])
def test_chunked_prompt_matches_reference(device, params):
    """A prompt in chunks of 13 tokens per sequence, each chunk written (cache_write_ref) before
    the next: later chunks read the earlier ones from the pools, history and ring."""
    case = _case(params, device, extra_tokens=39)
    new = [13] * len(LENS)
    for step in range(3):
        q, k, v = _tokens(params, new, device, seed=step)
        _check(*_both(case, q, k, v, new))
        cu = torch.tensor([0] + new).cumsum(0).to(device=device, dtype=torch.int32)
        cache_write_ref(k, v, cu, case.cache_lens, case.window_table, case.quant_table, *case.pools, case.sink,
                        case.recent, case.bits, case.group_size, case.clip_k, case.clip_v)  # fmt: skip
        case.append(k, v, cu)


@pytest.mark.parametrize("params", [CASES[1], CASES[7], CASES[8]])
def test_deterministic_rows_do_not_depend_on_the_chunking(device, params):
    """Deterministic mode (``ALIGNED``): key blocks at absolute positions whatever the query
    block, so a row's bits are the same whichever chunk it comes in: 39 tokens per sequence in one
    call, against chunks of 13, of 2 + 37 and of 1 + 11 + 27 (each written, cache_write_ref, before
    the next). Each row's rounding is the same op on the same operands; the default runs split
    keys where the query block's boundary lies (``test_chunked_prompt_matches_reference``)."""
    from oscar_compile.kernels.attention.prefill.attention_decode_consistent_triton import (
        attention_decode_consistent_triton,
    )
    from oscar_compile.kernels.determinism import deterministic

    prompt = _tokens(params, [39] * len(LENS), device, seed=3)

    def run(chunks):
        case = _case(params, device, extra_tokens=39)
        D, out, done = prompt[0].shape[2], [], 0
        for n in chunks:
            rows = torch.cat([torch.arange(39 * i + done, 39 * i + done + n) for i in range(len(LENS))]).to(device)
            q, k, v = (x[rows] for x in prompt)
            cu = torch.tensor([0] + [n] * len(LENS)).cumsum(0).to(device=device, dtype=torch.int32)
            args = (q, k, v, cu, case.cache_lens, case.window_table, case.quant_table, *case.pools, D**-0.5,
                    case.sink, case.recent, case.bits, case.group_size, case.clip_k, case.clip_v)  # fmt: skip
            with deterministic():
                out.append(attention_decode_consistent_triton(*args, history_lens=case.history_lens).view(
                    len(LENS), n, *q.shape[1:]))  # fmt: skip
            cache_write_ref(k, v, cu, case.cache_lens, case.window_table, case.quant_table, *case.pools, case.sink,
                            case.recent, case.bits, case.group_size, case.clip_k, case.clip_v)  # fmt: skip
            case.append(k, v, cu)
            done += n
        return torch.cat(out, dim=1)

    whole = run([39])
    for chunks in ([13, 13, 13], [2, 37], [1, 11, 27]):
        assert torch.equal(run(chunks), whole), chunks


def test_no_new_tokens(device):
    case = _case(CASES[0], device)
    q, k, v = _tokens(CASES[0], [0] * len(LENS), device)
    got, want = _both(case, q, k, v, [0] * len(LENS))
    assert got.shape == want.shape == (0, 2, 64)


_COMPILE = """
import json, sys
from oscar_compile.kernels.attention.prefill.attention_decode_consistent_triton import compile_offline
out = []
for dtype, head_dim, g, aligned in json.loads(sys.argv[1]):
    ck = compile_offline(dtype, head_dim, g, aligned=aligned)
    ptx = ck.asm["ptx"]
    out.append({"local": ("ld.local" in ptx) or ("st.local" in ptx), "shared": ck.metadata.shared})
print(json.dumps(out))
"""


def test_kernel_compiles_for_sm90():
    """An offline sm_90 compile (not the interpreter's run; the deterministic mode's aligned key
    blocks too): no local memory, and shared memory
    within the 227 KiB an sm_90 block may use. In a child process: under TRITON_INTERPRET=1 the
    kernel is an interpreter function."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton")
    configs = [("bf16", 128, 4, False), ("fp32", 64, 1, False), ("fp16", 128, 8, False), ("bf16", 128, 4, True)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(configs)], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert all(not g["local"] and g["shared"] <= 227 * 1024 for g in got), got


@pytest.mark.parametrize("params", CASES)
@pytest.mark.parametrize("hits", [None, HITS], ids=["standard", "hits"])
def testpacked_views_are_the_references_views_bitwise(params, hits):
    """The views built for a whole call at once (one scatter, one quantizer call) equal the
    reference's per-sequence ``decode_consistent_views``, bitwise: the quantizer works row by row."""
    pytest.importorskip("triton")
    from oscar_compile.kernels.attention.prefill.attention_decode_consistent_ref import decode_consistent_views
    from oscar_compile.kernels.attention.prefill.attention_decode_consistent_triton import packed_views
    from oscar_compile.kernels.pools import history_lens_of

    case = _case(params, "cpu", hits)
    _, k, v = _tokens(params, NEW, "cpu")
    cu = [0, *torch.tensor(NEW).cumsum(0).tolist()]
    lens = case.cache_lens.tolist()
    hists = history_lens_of(case.cache_lens, case.history_lens, case.sink, case.recent)
    tables = (case.window_table, case.quant_table)
    rules = (case.sink, case.recent, case.bits, case.group_size, case.clip_k, case.clip_v, torch.float32)
    views, starts = packed_views(k, v, cu, lens, hists, tables, tuple(case.pools), *rules)
    k_win, v_win, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = case.pools
    for i, L in enumerate(lens):
        a, b = cu[i], cu[i + 1]
        if a == b:
            continue
        geometry = (case.sink, case.recent, case.bits, case.group_size, hists[i])
        rows = slice(int(starts[i]), int(starts[i]) + L + b - a)
        want = (*decode_consistent_views(i, L, k[a:b], k_win, k_codes, k_scale, k_zero, tables, geometry,
                                         case.clip_k, "k"),
                *decode_consistent_views(i, L, v[a:b], v_win, v_codes, v_scale, v_zero, tables, geometry,
                                         case.clip_v, "v"))  # fmt: skip
        for got, ref in zip(views, want, strict=True):
            assert torch.equal(got[rows], ref)
